from .proposers import DFlashProposer, Proposer
from .speculative import speculative_generate
from .steps import GenerationResult

__all__ = ["DFlashProposer", "Proposer", "GenerationResult", "speculative_generate"]
