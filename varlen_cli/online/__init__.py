"""online (draft)."""
from .planner import OnlinePlanner, Step
from .step import StepPlan, plan_step

__all__ = ["OnlinePlanner", "Step", "StepPlan", "dataloader_for_stream", "plan_step"]


def dataloader_for_stream(iterable, planner, collate=None, **kwargs):
    from .loader import dataloader_for_stream as make

    return make(iterable, planner, collate, **kwargs)
