"""moeferry: serve large Mixture-of-Experts language models from one consumer GPU."""
from moeferry.llm import LLM

__all__ = ["LLM"]
__version__ = "0.1.0"
