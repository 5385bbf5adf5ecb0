"""Every callback of the page, built on one shared context; ui/app.py wires them to the components."""

from __future__ import annotations

from dataclasses import dataclass

from .bounds import LOCAL, FormBounds
from .chat import ChatCallbacks
from .compare import CompareCallbacks
from .context import AppContext
from .forms import MAX_FILE_BYTES, MethodChoice
from .loading import ModelLoading
from .queue import ComputeQueue
from .state import ModelCache


@dataclass
class Callbacks:
    """The page's callbacks by concern (the result tabs' callbacks are functions of ui/views.py)."""

    context: AppContext
    turns: ChatCallbacks
    comparisons: CompareCallbacks
    loading: ModelLoading
    method_choice: MethodChoice

    @classmethod
    def create(
        cls,
        cache: ModelCache,
        default_model: str,
        turn_time_limit: float | None = None,
        max_file_bytes: int = MAX_FILE_BYTES,
        bounds: FormBounds = LOCAL,
    ) -> Callbacks:
        context = AppContext(
            cache, default_model, turn_time_limit=turn_time_limit, max_file_bytes=max_file_bytes, bounds=bounds
        )
        return cls(context, ChatCallbacks(context), CompareCallbacks(context), ModelLoading(context), MethodChoice())

    @property
    def queue(self) -> ComputeQueue:
        return self.context.queue
