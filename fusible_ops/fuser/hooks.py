"""Ops with module hooks: they run alone through ``nn.Module.__call__``, the rest fused.

A mixin of :class:`~fusible_ops.fuser.OperationFuser`: the runs of ops without hooks
between hooked ones get a sub-fuser each; the plan records why the hooked op ran alone.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from ..core.dtypes import compute_dtype
from ..core.settings import current_settings, settings
from .plan import FusionDecision, FusionPlan, PlanEntry

if TYPE_CHECKING:
    from .operation_fuser import OperationFuser


def decision_in_sequential(decision: FusionDecision, first_index: int) -> FusionDecision:
    """A rule's decision (group-local indices) in the Sequential's indices."""
    if not first_index:
        return decision
    return replace(decision, indices=tuple(i + first_index for i in decision.indices))


def _shifted(entry: PlanEntry, offset: int) -> PlanEntry:
    return PlanEntry(entry.op, tuple(i + offset for i in entry.indices), entry.backend)


class HookedSegments:
    """Running and planning a fuser whose ops have module hooks (see the module doc)."""

    def _explain_segmented(self, meta, input_requires_grad, extra_inputs, kwargs, guard, hooked):
        segments = self._segments_for(hooked)
        plans = []
        for indices, fuser in segments:
            sub = fuser or type(self)(
                [self.ops[indices[0]]],
                honour_hooks=False,
                first_index=self._index_of(indices[0]),
                recipe=self.recipe,
            )
            flat_extra = [t for i in indices for t in extra_inputs[i]]
            plan, meta = sub.explain(
                meta, input_requires_grad, flat_extra, [kwargs[i] for i in indices], guard
            )
            input_requires_grad = input_requires_grad or plan.requires_grad
            plans.append(plan)
        return self._segmented_plan(segments, hooked, plans, meta.device, meta.dtype), meta

    def _call_segmented(
        self, input_: torch.Tensor, extra_inputs: list[tuple], kwargs: list[dict], hooked: list[str | None]
    ):
        """Ops with module hooks run alone through ``nn.Module.__call__`` so the hooks fire
        with the tensors the op sees; the runs between them are fused as usual."""
        segments = self._segments_for(hooked)
        x = input_
        extra_outputs: list[torch.Tensor] = []
        for indices, fuser in segments:
            if fuser is None:
                i = indices[0]
                if self.recipe is None:
                    result = self.ops[i](x, *extra_inputs[i], **kwargs[i])
                else:  # the op runs alone (its own fuser): the module's recipe still wins
                    with settings(recipe=self.recipe):
                        result = self.ops[i](x, *extra_inputs[i], **kwargs[i])
            else:
                result = fuser(
                    x,
                    *[t for i in indices for t in extra_inputs[i]],
                    basic_op_kwargs=[kwargs[i] for i in indices],
                )
            if isinstance(result, tuple):
                x, *outs = result
                extra_outputs.extend(outs)
            else:
                x = result
        if not torch.compiler.is_compiling():  # traced calls record no plan (the parts have none)
            plans = [None if fuser is None else fuser.last_plan for _, fuser in segments]
            dtype = compute_dtype(input_.dtype, input_.device)
            self._record_plan(self._segmented_plan(segments, hooked, plans, input_.device, dtype))
        return (x, *extra_outputs) if extra_outputs else x

    def _segments_for(self, hooked: list[str | None]) -> list[tuple[list[int], OperationFuser | None]]:
        """Runs of ops without hooks (a fuser each) and hooked ops (None: called alone), cached."""
        key = tuple(bool(h) for h in hooked)
        segments = self._segments.get(key)
        if segments is None:
            segments, run = [], []
            for i, reason in enumerate(hooked):
                if reason is None:
                    run.append(i)
                    continue
                if run:
                    segments.append((run, self._sub_fuser(run)))
                    run = []
                segments.append(([i], None))
            if run:
                segments.append((run, self._sub_fuser(run)))
            self._segments[key] = segments
        return segments

    def _index_of(self, index: int) -> int | None:
        return None if self.first_index is None else self.first_index + index

    def _sub_fuser(self, indices: list[int]) -> OperationFuser:
        return type(self)(
            [self.ops[j] for j in indices], first_index=self._index_of(indices[0]), recipe=self.recipe
        )

    def _segmented_plan(
        self,
        segments: list,
        hooked: list[str | None],
        plans: list[FusionPlan | None],
        device: torch.device,
        dtype: torch.dtype,
    ) -> FusionPlan:
        forward, backward, decisions = [], [], []
        template = None
        for (indices, fuser), plan in zip(segments, plans):
            first = indices[0]
            if fuser is None:
                op = self.ops[first]
                entry = PlanEntry(op, (first,), op.plan_backend(device, dtype))
                forward.append(entry)
                backward.append(entry)
                decisions.append(
                    FusionDecision(
                        "module_hooks",
                        "joint",
                        ((self.first_index or 0) + first,),
                        False,
                        reason=f"{hooked[first]} on {self.label(first)}: it runs alone, unfused, "
                        "through nn.Module.__call__",
                    )
                )
                continue
            template = plan
            forward.extend(_shifted(e, first) for e in plan.forward)
            backward.extend(_shifted(e, first) for e in plan.backward)
            # a sub-fuser in a Sequential already speaks in its indices
            decisions.extend(
                plan.decisions
                if self.first_index is not None
                else [decision_in_sequential(d, first) for d in plan.decisions]
            )
        return FusionPlan(
            op_names=[op.op_name() for op in self.ops],
            forward=forward,
            backward=backward,
            decisions=decisions,
            fusion_enabled=current_settings().fusion,
            dtype=template.dtype if template else dtype,
            device=template.device if template else device,
            requires_grad=True,
            first_index=self.first_index or 0,
        )
