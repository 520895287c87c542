from .adapter import TargetModel, TargetState, UnsupportedTargetError

__all__ = ["TargetModel", "TargetState", "UnsupportedTargetError"]
