"""moeferry: serve large Mixture-of-Experts language models from one consumer GPU."""
from moeferry.llm import LLM, GenerationOutput
from moeferry.scheduler.sampling import SamplingParams

__all__ = ["LLM", "GenerationOutput", "SamplingParams"]
__version__ = "0.1.0"
