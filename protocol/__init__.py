"""Wire types shared by frontends and engine cores: msgspec Structs only."""

from protocol.messages import PROTOCOL_VERSION
from protocol.sampling_params import SamplingParams, SamplingParamsError

__all__ = ["PROTOCOL_VERSION", "SamplingParams", "SamplingParamsError"]
