from .proposers import DFlashProposer, Proposer
from .speculative import GenerationResult, speculative_generate

__all__ = ["DFlashProposer", "Proposer", "GenerationResult", "speculative_generate"]
