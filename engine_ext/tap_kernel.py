"""The device-mode tap as one Triton kernel per site: one program per token row.

Rows of requests without hooks (slot 0, most rows in a typical batch) return at
once, so a site costs one small launch instead of a dozen full-tensor passes. The
arithmetic is the torch reference's (`HookRuntime._tap_dense_torch`): per kind (sublayer
output, then stream) x <- round(x + alpha (src.u) u + w), then the captured value is
copied to its staging row. A row reads only what its entries need (identity: nothing,
`add`: w, projections: u and the residual) and writes x back only when steered, so
steering every layer costs one small read of w per steered row and site.
Set CAPSTEER_TAP_KERNEL=torch to use the reference.

Launch cost matters more than the kernel: a step too large for CUDA graphs (a long
prefill) calls the tap from Python at every steered site, and Triton's `JITFunction.run`
spends ~25 us a call binding and specialising 21 arguments and asking the driver about
each of 11 pointers (H100, `bench/tap_launch.py`), where the kernel itself runs ~6 us.
After the first launch of a specialisation, `tap` calls the compiled kernel's launcher
directly with integer addresses (the runtime's buffers never move). Only for the Triton
release whose launcher it was written against (`DIRECT_TRITON`); other releases, the CPU
interpreter and CAPSTEER_TAP_LAUNCH=jit take the JIT path.
"""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU builds: host mode never uses this
    triton = None


# The launcher signature `_direct` calls: CompiledKernel.run(gx, gy, gz, stream, function,
# packed_metadata, launch_metadata, enter_hook, exit_hook, *kernel args).
DIRECT_TRITON = ("3.6.",)


def direct_launch_supported() -> bool:
    return (triton is not None and triton.__version__.startswith(DIRECT_TRITON)
            and os.environ.get("TRITON_INTERPRET", "0") in ("", "0")
            and os.environ.get("CAPSTEER_TAP_LAUNCH", "direct") != "jit")


def available(device: torch.device) -> bool:
    return (triton is not None and device.type == "cuda"
            and os.environ.get("CAPSTEER_TAP_KERNEL", "triton") != "torch")


if triton is not None:
    _TL = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}

    # `site` differs at every call: never specialise on it (a kernel compiled for site 1 or
    # for a multiple of 16 would be wrong for other sites when launched directly).
    @triton.jit(do_not_specialize=["site"])
    def _tap(x_ptr, r_ptr, slot_ptr, gen_ptr, rank_ptr, slot_entry_ptr, point_base_ptr,
             u_ptr, w_ptr, alpha_ptr, staging_ptr, site, num_sites, hidden, stride_x, stride_r,
             stride_s, HAS_RES: tl.constexpr, KINDS: tl.constexpr, DTYPE: tl.constexpr,
             BLOCK: tl.constexpr):
        # A decode step's tap covers a few hundred rows: its time is the chain of dependent
        # loads (row -> slot -> entry -> vector), not bandwidth. So every load a row may need
        # is issued before the first store, predicated by mask rather than by a branch, and
        # waits on as few earlier loads as possible: (slot, class, rank), then (entries,
        # copy bases, x), then (alpha, w), then (u, residual). A store before a load would
        # hold that load back (the compiler cannot tell they never alias).
        row = tl.program_id(0)
        slot = tl.load(slot_ptr + row)
        gen = tl.load(gen_ptr + row)
        rank = tl.load(rank_ptr + row)
        if slot != 0:
            offs = tl.arange(0, BLOCK)
            mask = offs < hidden
            entries = slot_entry_ptr + (slot * 2 + gen) * 2 * num_sites + site
            bases = point_base_ptr + slot * 2 * num_sites + site
            x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
            if KINDS & 1:  # the sublayer output (compile-time: the kinds this call carries)
                e0 = tl.load(entries)
                base0 = tl.load(bases)
                alpha0 = tl.load(alpha_ptr + e0)
                # Only what the entry needs is read: an identity entry (0) reads nothing
                # and writes nothing back; `add` reads w only; a projection also reads u.
                # (A row-uniform predicate is a length: elements below it are read.)
                n_w0 = hidden * (e0 != 0).to(tl.int32)
                n_u0 = n_w0 * (alpha0 != 0.0).to(tl.int32)
                w0 = tl.load(w_ptr + e0 * hidden + offs, mask=offs < n_w0, other=0.0)
                u0 = tl.load(u_ptr + e0 * hidden + offs, mask=offs < n_u0, other=0.0)
            if KINDS & 2:  # the stream (x + residual when the call has one)
                e1 = tl.load(entries + num_sites)
                base1 = tl.load(bases + num_sites)
                alpha1 = tl.load(alpha_ptr + e1)
                n_w1 = hidden * (e1 != 0).to(tl.int32)
                n_u1 = n_w1 * (alpha1 != 0.0).to(tl.int32)
                w1 = tl.load(w_ptr + e1 * hidden + offs, mask=offs < n_w1, other=0.0)
                u1 = tl.load(u_ptr + e1 * hidden + offs, mask=offs < n_u1, other=0.0)
                if HAS_RES:  # the residual: for a projection of the stream or its copy
                    n_r = tl.maximum(n_u1, hidden * ((base1 >= 0) & (rank >= 0)).to(tl.int32))
                    r = tl.load(r_ptr + row * stride_r + offs, mask=offs < n_r,
                                other=0.0).to(tl.float32)
            if KINDS & 1:
                if e0 != 0:
                    if alpha0 != 0.0:
                        x = x + alpha0 * tl.sum(x * u0, axis=0) * u0
                    x = (x + w0).to(DTYPE).to(tl.float32)
                    tl.store(x_ptr + row * stride_x + offs, x.to(DTYPE), mask=mask)
                if (base0 >= 0) & (rank >= 0):
                    tl.store(staging_ptr + (base0 + rank) * stride_s + offs, x.to(DTYPE),
                             mask=mask)
            if KINDS & 2:
                if e1 != 0:
                    if alpha1 != 0.0:
                        src = x + r if HAS_RES else x
                        x = x + alpha1 * tl.sum(src * u1, axis=0) * u1
                    x = (x + w1).to(DTYPE).to(tl.float32)
                    tl.store(x_ptr + row * stride_x + offs, x.to(DTYPE), mask=mask)
                if (base1 >= 0) & (rank >= 0):
                    val = (x + r).to(DTYPE) if HAS_RES else x.to(DTYPE)
                    tl.store(staging_ptr + (base1 + rank) * stride_s + offs, val, mask=mask)


def tap(runtime, x: torch.Tensor, residual: torch.Tensor | None, site: int,
        kinds: int = 3) -> None:
    """Launch the kernel over this forward's rows (padded rows have slot 0)."""
    n, hidden = x.shape
    if n == 0:
        return
    res = residual if residual is not None else x
    xp, rp = x.data_ptr(), res.data_ptr()
    # Everything the JIT specialises on, but `site` (never) and the runtime's buffers
    # (fixed for the runtime's life): pointer types (the residual may be an fp32 copy at
    # one site and bf16 at the next) and alignment, strides, constexprs.
    key = (residual is not None, kinds, x.dtype, hidden, x.stride(0), res.stride(0), xp & 15,
           rp & 15, res.dtype)
    launch = runtime.tap_launchers.get(key)
    if launch is not None:
        run, function, metadata, device, fixed, tail = launch
        run(n, 1, 1, _raw_stream(device), function, metadata, None, None, None,
            xp, rp, *fixed, site, runtime.num_sites, hidden, key[4], key[5], *tail)
        return
    consts = (residual is not None, kinds, _TL[x.dtype], triton.next_power_of_2(hidden))
    kernel = _tap[(n,)](
        x, res, runtime.tok_slot, runtime.tok_gen, runtime.tok_rank, runtime.slot_entry,
        runtime.point_base, runtime.u, runtime.w, runtime.alpha, runtime.staging, site,
        runtime.num_sites, hidden, x.stride(0), res.stride(0), runtime.staging.stride(0),
        HAS_RES=consts[0], KINDS=consts[1], DTYPE=consts[2], BLOCK=consts[3])
    if runtime.tap_direct and all(hasattr(kernel, a) for a in ("run", "function",
                                                             "packed_metadata")):
        fixed = tuple(t.data_ptr() for t in (
            runtime.tok_slot, runtime.tok_gen, runtime.tok_rank, runtime.slot_entry,
            runtime.point_base, runtime.u, runtime.w, runtime.alpha, runtime.staging))
        runtime.tap_launchers[key] = (kernel.run, kernel.function, kernel.packed_metadata,
                                      torch.cuda.current_device(), fixed,
                                      (runtime.staging.stride(0), *consts))


def _raw_stream(device_index: int) -> int:
    return torch._C._cuda_getCurrentRawStream(device_index)
