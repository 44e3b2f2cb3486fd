"""Grouped-GEMM backend on the cuDNN frontend (``nvidia-cudnn-frontend``, module ``cudnn``).

Two paths, chosen by :mod:`.cudnn_fe_probe`:

- **blackwell** (SM100/SM103): fc1 + GLU + probability scaling in one
  ``grouped_gemm_glu_wrapper_sm100`` call (BF16, or MXFP8 with ``recipe="mxfp8"``);
  plain grouped GEMMs through ``grouped_gemm_wrapper_sm100`` (BF16) or
  ``grouped_gemm_quant_wrapper_sm100`` (MXFP8), both writing into ``d_tensor``;
  backward through ``grouped_gemm_dglu_wrapper_sm100`` and
  ``grouped_gemm_wgrad_wrapper_sm100`` (BF16).
- **hopper** (SM90, cuDNN >= 9.18): fprop and dgrad through the graph-API
  ``moe_grouped_matmul`` with the output tensor bound to the caller's buffer; bias is
  added and wgrad computed with per-group torch matmuls (noted in :meth:`plan_notes`).

All kernel rules (256-row alignment, GLU column layout, MXFP8 scale layout) live in
:mod:`.cudnn_fe_adapter`. Where a caller buffer cannot be written directly (rows need
padding) the kernel writes a padded scratch and one gather copies the rows back;
:meth:`plan_notes` says so. Both paths are unverified on hardware (see docs/backend-cudnn.md).
"""

from __future__ import annotations

from typing import Any

import torch

from ..activation import ActivationSpec, activation_forward, scaled_activation_forward
from ..base import GroupedGemmBackend, group_ids_from_offsets
from ..grouped_checks import host_split_sizes
from ..pytorch.loop import _row_ranges
from . import adapter
from . import probe as probe_mod

RECIPES = ("bf16", "mxfp8")


def _device_index(device: torch.device) -> int:
    return device.index if device.type == "cuda" and device.index is not None else 0


def _stream_kwargs(device: torch.device) -> dict:
    """``current_stream`` for the wrappers, so kernels run on torch's current stream."""
    if device.type != "cuda":
        return {}
    from cuda.bindings import driver

    return {"current_stream": driver.CUstream(torch.cuda.current_stream(device).cuda_stream)}


def _build_hopper_graph(module: Any, token: torch.Tensor, weight: torch.Tensor, bounds: torch.Tensor) -> Any:
    """Build the cuDNN graph ``out(1, M, N) = moe_grouped_matmul(token, weight, bounds)``.

    Tensor uids are 1/2/3 (inputs) and 100 (output); returns the built graph.
    """
    io = {torch.bfloat16: module.data_type.BFLOAT16, torch.float16: module.data_type.HALF}[token.dtype]
    graph = module.pygraph(intermediate_data_type=io, compute_data_type=module.data_type.FLOAT)

    def tensor(name: str, t: torch.Tensor, dtype: Any, uid: int) -> Any:
        return graph.tensor(name=name, dim=list(t.shape), stride=list(t.stride()), data_type=dtype, uid=uid)

    out = graph.moe_grouped_matmul(
        token=tensor("token", token, io, 1),
        weight=tensor("weight", weight, io, 2),
        first_token_offset=tensor("first_token_offset", bounds, module.data_type.INT32, 3),
        mode=module.moe_grouped_matmul_mode.NONE,
        compute_data_type=module.data_type.FLOAT,
        name="moe",
    )
    m, n = token.shape[1], weight.shape[2]
    out.set_output(True).set_data_type(io).set_uid(100).set_dim([1, m, n]).set_stride([m * n, n, 1])
    graph.validate()
    graph.build_operation_graph()
    graph.create_execution_plans([module.heur_mode.A, module.heur_mode.FALLBACK])
    graph.check_support()
    graph.build_plans()
    return graph


class CudnnFrontendBackend(GroupedGemmBackend):
    """Grouped GEMMs (and the fused GLU on Blackwell) via the cuDNN frontend.

    Args:
        recipe: ``"bf16"`` or ``"mxfp8"`` (forward GEMMs quantised to MXFP8 on Blackwell;
            backward stays BF16).
    """

    name = "cudnn"
    description = "cuDNN frontend: fused grouped GEMM + GLU (SM100), graph-API grouped matmul (SM90)"

    def __init__(self, recipe: str = "bf16") -> None:
        if recipe not in RECIPES:
            raise ValueError(f"cudnn backend: recipe must be one of {RECIPES}, got {recipe!r}")
        self.recipe = recipe
        self._hopper_graphs: dict[tuple, Any] = {}
        self._hopper_handles: dict[torch.device, Any] = {}

    # ------------------------------------------------------------ availability
    def status(self, device: torch.device | None = None) -> probe_mod.CudnnFrontendStatus:
        return probe_mod.probe_cudnn_frontend(_device_index(device or torch.device("cuda")))

    def package_status(self) -> str | None:
        try:
            probe_mod._import_cudnn()
        except Exception as exc:
            return f"package nvidia-cudnn-frontend not installed ({type(exc).__name__}: {exc})"
        return None

    def info(self) -> str:
        """One line for ``python -m fusible_ops info``."""
        return self.status().summary()

    def probe(self, device: torch.device, dtype: torch.dtype) -> str | None:
        st = self.status(device)
        if st.reason is not None:
            return st.reason
        if device.type != "cuda":
            return f"cudnn backend runs on CUDA tensors only, got device {device}"
        allowed = (torch.bfloat16,) if st.path == "blackwell" else (torch.bfloat16, torch.float16)
        if dtype not in allowed:
            return f"cudnn {st.path} path supports {allowed}, got {dtype}"
        return None

    def auto_probe(self, device: torch.device, dtype: torch.dtype) -> str | None:
        """Automatic selection takes only the Blackwell path; Hopper's is opt-in.

        On SM90 the weight gradient runs as a host-synced torch loop, so the graph-API
        path is chosen only with ``settings(backend="cudnn")``.
        """
        reason = self.probe(device, dtype)
        if reason is None and self.status(device).path != "blackwell":
            return "the Hopper graph-API path is opt-in (settings(backend='cudnn')): its wgrad syncs the host"
        return reason

    def require(self, device: torch.device, dtype: torch.dtype) -> None:
        """Raise naming the missing piece; for ``settings(backend="cudnn")``."""
        reason = self.probe(device, dtype)
        if reason is not None:
            raise RuntimeError(f"backend 'cudnn' was forced but cannot run: {reason}")

    @property
    def fused_activation(self) -> bool:  # type: ignore[override]
        return self.status().path == "blackwell"

    def fused_activation_reason(self, spec: ActivationSpec, device: torch.device) -> str | None:
        """Why fc1_fprop_act / fc2_dgrad_act would run composed instead of fused (None if fused)."""
        path = self.status(device).path
        if path != "blackwell":
            return f"cudnn fused GLU kernels need the blackwell path (have {path})"
        return adapter.glu_unsupported_reason(spec)

    def plan_notes(
        self, device: torch.device, split_sizes: list[int] | None, with_output_buffer: bool
    ) -> list[str]:
        """Copies and composed steps this backend will perform, for the fusion plan."""
        path = self.status(device).path
        notes = []
        if path == "blackwell":
            aligned = split_sizes is not None and all(s % adapter.M_ALIGN == 0 for s in split_sizes)
            if not aligned:
                notes.append(
                    "cudnn: expert rows padded to multiples of 256 (inputs scattered; results gathered back)"
                )
                if with_output_buffer:
                    notes.append("cudnn: output buffer written by one gather copy from a padded scratch")
            if self.recipe == "mxfp8":
                notes.append("cudnn: forward operands quantised to MXFP8 per call (backward in BF16)")
        elif path == "hopper":
            notes.append("cudnn: bias add and wgrad run as torch ops on the hopper path")
        return notes

    def _module(self, device: torch.device) -> tuple[str, Any]:
        st = self.status(device)
        if st.reason is not None:
            raise RuntimeError(f"backend 'cudnn' cannot run: {st.reason}")
        return st.path, probe_mod._import_cudnn()

    def _check_runnable(self, where: str, rows: torch.Tensor) -> None:
        self._module(rows.device)

    # ------------------------------------------------------------ hooks (arguments checked)
    def _fprop(self, x, weight, split_sizes, offsets, bias, out) -> torch.Tensor:
        path, module = self._module(x.device)
        if path == "hopper":
            out = self._hopper_matmul(module, x, weight.transpose(1, 2), offsets, out)
            if bias is not None:
                out += bias[group_ids_from_offsets(offsets, x.shape[0])]
            return out
        return self._blackwell_gemm(module, x, weight, split_sizes, offsets, bias=bias, out=out, dgrad=False)

    def _dgrad(self, grad_out, weight, split_sizes, offsets, out) -> torch.Tensor:
        path, module = self._module(grad_out.device)
        if path == "hopper":
            return self._hopper_matmul(module, grad_out, weight, offsets, out)
        return self._blackwell_gemm(
            module, grad_out, weight, split_sizes, offsets, bias=None, out=out, dgrad=True
        )

    def _wgrad(self, grad_out, x, split_sizes, offsets, out) -> torch.Tensor:
        path, module = self._module(x.device)
        if out is None:
            out = x.new_empty(offsets.shape[0], grad_out.shape[1], x.shape[1])
        out.zero_()  # empty groups must read as zeros whatever the kernel does with them
        if path == "hopper":
            for g, start, end in _row_ranges(host_split_sizes(split_sizes, offsets)):
                torch.mm(grad_out[start:end].t(), x[start:end], out=out[g])
            return out
        kwargs = adapter.wgrad_kwargs(
            grad_out=grad_out.contiguous(), x=x.contiguous(), offsets=offsets, out=out
        )
        module.grouped_gemm_wgrad_wrapper_sm100(**kwargs, **_stream_kwargs(x.device))
        return out

    def _fc1_fprop_act(self, x, weight, bias, split_sizes, offsets, activation, scales):
        """fc1 + GLU + probability scaling in one Blackwell kernel."""
        _, module = self._module(x.device)
        rows, two_n = x.shape[0], weight.shape[1]
        layout = adapter.pad_rows(split_sizes, offsets, rows)
        perm = adapter.glu_kernel_column_order(two_n, activation.glu_interleave_size).to(x.device)
        reorder = not adapter.is_identity_permutation(perm)
        weight_k = weight.index_select(1, perm) if reorder else weight.contiguous()
        bias_k = adapter.bias_kernel_layout(bias, perm) if bias is not None else None
        prob = scales.float() if scales is not None else x.new_ones(rows, dtype=torch.float32)
        a = adapter.scatter_rows(x, layout)
        sfa = sfb = norm = None
        if self.recipe == "mxfp8":
            a, sfa = adapter.mxfp8_operand(a)
            weight_k, sfb = adapter.mxfp8_operand(weight_k)
            norm = torch.ones(1, dtype=torch.float32, device=x.device)
        kwargs = adapter.glu_forward_kwargs(
            a=a,
            weight=weight_k,
            padded_offsets=layout.padded_offsets,
            alpha=torch.ones(weight.shape[0], dtype=torch.float32, device=x.device),
            prob=adapter.scatter_rows(prob, layout),
            bias=bias_k,
            spec=activation,
            out_dtype=x.dtype,
            sfa=sfa,
            sfb=sfb,
            norm_const=norm,
        )
        result = module.grouped_gemm_glu_wrapper_sm100(**kwargs, **_stream_kwargs(x.device))
        pre = adapter.gather_rows(result["c_tensor"], layout)
        if reorder:
            pre = pre.index_select(1, adapter.inverse_permutation(perm))
        return pre, adapter.gather_rows(result["d_tensor"], layout)

    def _fc2_dgrad_act(self, grad_y, weight, pre, split_sizes, offsets, activation, scales):
        """fc2 dgrad + GLU backward + the probabilities' gradient in one Blackwell kernel."""
        _, module = self._module(grad_y.device)
        rows, two_n = pre.shape
        layout = adapter.pad_rows(split_sizes, offsets, rows)
        perm = adapter.glu_kernel_column_order(two_n, activation.glu_interleave_size).to(pre.device)
        reorder = not adapter.is_identity_permutation(perm)
        pre_k = pre.index_select(1, perm) if reorder else pre
        prob = scales.float() if scales is not None else pre.new_ones(rows, dtype=torch.float32)
        # bound to a name: the wrapper only receives the experts' pointers, so a temporary
        # contiguous copy must outlive the call
        fc2_weight = weight.contiguous()
        kwargs = adapter.dglu_kwargs(
            grad=adapter.scatter_rows(grad_y, layout),
            pre=adapter.scatter_rows(pre_k, layout),
            padded_offsets=layout.padded_offsets,
            prob=adapter.scatter_rows(prob, layout),
            dprob=torch.zeros(layout.capacity, dtype=torch.float32, device=pre.device),
            fc2_weight=fc2_weight,
            spec=activation,
            out_dtype=pre.dtype,
        )
        result = module.grouped_gemm_dglu_wrapper_sm100(**kwargs, **_stream_kwargs(pre.device))
        del fc2_weight  # kept alive until the wrapper has run
        grad_pre = adapter.gather_rows(result["d_row_tensor"].reshape(layout.capacity, two_n), layout)
        if reorder:
            grad_pre = grad_pre.index_select(1, adapter.inverse_permutation(perm))
        if scales is None:
            return grad_pre, None, activation_forward(activation, pre)
        dprob = adapter.gather_rows(result["dprob_tensor"].reshape(-1), layout)
        return grad_pre, dprob.to(scales.dtype), scaled_activation_forward(activation, pre, scales)

    # ------------------------------------------------------------ path helpers
    def _blackwell_gemm(self, module, a_rows, weight, split_sizes, offsets, *, bias, out, dgrad: bool):
        """fprop (``weight`` dense, ``[G, N, K]``) or dgrad (``weight[g]`` bound N-major) of the
        hooks' arguments (``module``: the imported frontend); returns the result rows."""
        device, dtype = a_rows.device, a_rows.dtype
        cols = weight.shape[2] if dgrad else weight.shape[1]
        layout = adapter.pad_rows(split_sizes, offsets, a_rows.shape[0])
        a = adapter.scatter_rows(a_rows, layout)
        target, _ = adapter.output_target(layout, out, cols, dtype, device)
        alpha = torch.ones(weight.shape[0], dtype=torch.float32, device=device)
        bias_k = adapter.bias_kernel_layout(bias) if bias is not None else None
        if self.recipe == "mxfp8" and not dgrad:
            a_q, sfa = adapter.mxfp8_operand(a)
            w_q, sfb = adapter.mxfp8_operand(weight.contiguous())
            kwargs = adapter.quant_gemm_kwargs(
                a=a_q,
                sfa=sfa,
                padded_offsets=layout.padded_offsets,
                alpha=alpha,
                weight=w_q,
                sfb=sfb,
                d_tensor=target,
                out_dtype=dtype,
                norm_const=torch.ones(1, dtype=torch.float32, device=device),
                bias=bias_k,
            )
            result = module.grouped_gemm_quant_wrapper_sm100(**kwargs, **_stream_kwargs(device))
        else:
            w = weight.contiguous()
            kwargs = adapter.grouped_gemm_kwargs(
                a=a,
                padded_offsets=layout.padded_offsets,
                alpha=alpha,
                d_tensor=target,
                out_dtype=dtype,
                weight=None if dgrad else w,
                b_ptrs=adapter.expert_pointers(w) if dgrad else None,
                n=cols if dgrad else None,
                bias=bias_k,
            )
            result = module.grouped_gemm_wrapper_sm100(**kwargs, **_stream_kwargs(device))
        written = result["d_tensor"].reshape(target.shape)
        if written.data_ptr() != target.data_ptr():
            raise RuntimeError("cudnn backend: wrapper did not write into the provided d_tensor")
        return adapter.gather_rows(target, layout, out)

    def _hopper_matmul(
        self,
        module: Any,
        x: torch.Tensor,
        weight_kn: torch.Tensor,
        offsets: torch.Tensor,
        out: torch.Tensor | None,
    ) -> torch.Tensor:
        """``out[rows_g] = x[rows_g] @ weight_kn[g]`` with ``out`` bound as the graph's output."""
        token, weight_kn, bounds = adapter.hopper_matmul_operands(x, weight_kn, offsets)
        rows, cols = x.shape[0], weight_kn.shape[2]
        if out is None:
            out = x.new_empty(rows, cols)
        key = (tuple(token.shape), tuple(weight_kn.shape), tuple(weight_kn.stride()), x.dtype, x.device)
        graph = self._hopper_graphs.get(key)
        if graph is None:
            graph = self._hopper_graphs[key] = _build_hopper_graph(module, token, weight_kn, bounds)
        variant_pack = {1: token, 2: weight_kn, 3: bounds, 100: out.view(1, rows, cols)}
        workspace = torch.empty(graph.get_workspace_size(), dtype=torch.uint8, device=x.device)
        graph.execute(variant_pack, workspace, handle=self._hopper_handle(module, x.device))
        return out

    def _hopper_handle(self, module: Any, device: torch.device) -> Any:
        handle = self._hopper_handles.get(device)
        if handle is None:
            handle = self._hopper_handles[device] = module.create_handle()
        if device.type == "cuda":
            module.set_stream(handle=handle, stream=torch.cuda.current_stream(device).cuda_stream)
        return handle
