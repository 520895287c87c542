from .attention import build_block_mask
from .draft import DFlash2DraftModel
from .selector import CandidateSelector, SelectorOutput

__all__ = ["DFlash2DraftModel", "CandidateSelector", "SelectorOutput", "build_block_mask"]
