"""Wire types shared by frontends and engine cores: msgspec Structs only."""

from pagoda.protocol.messages import PROTOCOL_VERSION
from pagoda.protocol.sampling_params import SamplingParams, SamplingParamsError

__all__ = ["PROTOCOL_VERSION", "SamplingParams", "SamplingParamsError"]
