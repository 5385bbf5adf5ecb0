"""What every callback shares: the model cache, the compute queue, the serving limits and the form's keys."""

from __future__ import annotations

from dataclasses import dataclass, field

from visualkv.media import MediaLimits
from visualkv.runtime.frame_cap import media_limits

from .bounds import LOCAL, FormBounds
from .forms import MAX_FILE_BYTES
from .queue import ComputeQueue
from .state import ModelCache, UserState


@dataclass
class AppContext:
    """The app's shared parts; per-user data arrives in each callback as its `state` argument."""

    cache: ModelCache
    default_model: str
    turn_time_limit: float | None = None  # seconds; a longer turn or comparison is stopped like Stop
    max_file_bytes: int = MAX_FILE_BYTES  # largest upload accepted (`--max-upload`)
    method_keys: list[tuple[str, str]] = field(default_factory=list)  # (method, setting key) of each settings input
    queue: ComputeQueue = field(default_factory=ComputeQueue)
    bounds: FormBounds = LOCAL  # the settings' maxima (ui/bounds.py: SHARED on a shared instance)

    def user_state(self, state: UserState | None) -> UserState:
        """The session's state, created on its first event."""
        return state if state is not None else UserState(model_name=self.default_model)

    def media_limits(self, method: str) -> MediaLimits:
        """What media `method` accepts on this instance (its frame cap, the upload limit)."""
        return media_limits(method, MediaLimits(max_file_bytes=self.max_file_bytes))
