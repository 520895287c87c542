from ..sampling import CandidateQ, SamplingParams, probs_from_logits, sample_from_probs
from .verifiers import VerifyResult, block_verify, greedy_verify, synthetic_verify, token_level_verify

__all__ = [
    "CandidateQ",
    "SamplingParams",
    "probs_from_logits",
    "sample_from_probs",
    "VerifyResult",
    "greedy_verify",
    "token_level_verify",
    "synthetic_verify",
    "block_verify",
]
