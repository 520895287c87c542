"""Hand-written GPU kernels, each with the plain torch reference it is tested against."""
