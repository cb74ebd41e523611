"""Baton's native inference engine: model, paged KV cache, block manager, sampler.

The services drive it through three objects: :class:`BlockManager` (which KV blocks a sequence
owns), :class:`ModelRunner` (one forward over a flat batch) and :class:`Sequence` (a request's
tokens and progress). Nothing here touches the broker.
"""

from shared.runtime.block_manager import BlockManager
from shared.runtime.model_config import ModelConfig
from shared.runtime.model_runner import ModelRunner
from shared.runtime.sampler import Sampler
from shared.runtime.sequence import Sequence, SequenceStatus
from shared.wire.sampling import SamplingParams

__all__ = [
    "BlockManager",
    "ModelConfig",
    "ModelRunner",
    "Sampler",
    "SamplingParams",
    "Sequence",
    "SequenceStatus",
]
