"""The device-mode tap as one Triton kernel per site: one program per token row.

Rows of requests without hooks (slot 0, most rows in a typical batch) return at
once, so a site costs one small launch instead of a dozen full-tensor passes. The
arithmetic is the torch reference's (`HookRuntime._tap_dense_torch`): per kind (sublayer
output, then stream) x <- round(x + alpha (src.u) u + w) where the entry's gate passes
(ungated, or gate_b + src.gate > 0), then a patched row's value is set (engine_ext/
patches.py: read only at rows whose patch rank is not -1), then the captured value is
copied to its staging row. A row reads only what its entries need (identity: nothing,
`add`: w, projections: u and the residual) and writes x back only when steered, so
steering every layer costs one small read of w per steered row and site.
Set CAPSTEER_TAP_KERNEL=torch to use the reference.

Launch cost matters more than the kernel: a step too large for CUDA graphs (a long
prefill) calls the tap from Python at every steered site, and Triton's `JITFunction.run`
spends ~25 us a call binding and specialising 21 arguments and asking the driver about
each of 11 pointers (measured on an H100), where the kernel itself runs ~6 us.
After the first launch of a specialisation, `tap` calls the compiled kernel's launcher
directly with integer addresses (the runtime's buffers never move). Only for the Triton
release whose launcher it was written against (`DIRECT_TRITON`); other releases, the CPU
interpreter and CAPSTEER_TAP_LAUNCH=jit take the JIT path.

`_expand` writes the per-row indices the tap reads (slot, position class) from three
numbers per batch request, once a step before the forward (`HookRuntime._expand_rows`).
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
             u_ptr, w_ptr, alpha_ptr, gate_ptr, gate_b_ptr, gated_ptr, keep_ptr, staging_ptr,
             prank_ptr, pbase_ptr, pvalues_ptr, pkeep_ptr, site, num_sites, hidden, stride_x,
             stride_r, stride_s, stride_t, HAS_RES: tl.constexpr, KINDS: tl.constexpr,
             DTYPE: tl.constexpr,
             BLOCK: tl.constexpr):
        # A decode step's tap covers a few hundred rows, so its time is the chain of
        # dependent loads (row -> slot -> entry -> vector). The row's scalars are loaded
        # together and before the first store (a store would hold back a later load: the
        # compiler cannot tell they never alias): slot, class and rank; then x with both
        # kinds' entries and copy bases. Vectors (w, u, residual) are loaded only where
        # used: a prefill step's tap is bandwidth-bound, and holding them all at once
        # costs occupancy (measured: 30% slower at 8192 rows).
        row = tl.program_id(0)
        slot = tl.load(slot_ptr + row)
        gen = tl.load(gen_ptr + row)
        rank = tl.load(rank_ptr + row)
        prank = tl.load(prank_ptr + row)  # -1 but at a patched position (engine_ext/patches)
        if slot != 0:
            offs = tl.arange(0, BLOCK)
            mask = offs < hidden
            entries = slot_entry_ptr + (slot * 2 + gen) * 2 * num_sites + site
            bases = point_base_ptr + slot * 2 * num_sites + site
            x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
            e0 = tl.load(entries)  # the sublayer output's entry and copy base
            base0 = tl.load(bases)
            e1 = tl.load(entries + num_sites)  # the stream's
            base1 = tl.load(bases + num_sites)
            for kind in tl.static_range(2):
                if (KINDS >> kind) & 1:  # the kinds this call carries (compile-time)
                    if kind == 0:
                        entry, base = e0, base0
                    else:
                        entry, base = e1, base1
                    # Only what the entry needs is read: an identity entry (0) reads nothing
                    # and writes nothing back; `add` reads w only; a projection also reads u
                    # and, on the stream, the residual.
                    if entry != 0:
                        # A gated entry (`when`) applies where gate_b + src . gate > 0, src
                        # read before it; an ungated one has gate_b 1. Its scalars load with
                        # alpha and w, so an ungated entry's chain of loads is no longer.
                        alpha = tl.load(alpha_ptr + entry)
                        score = tl.load(gate_b_ptr + entry)
                        gated = tl.load(gated_ptr + entry)
                        # Tables are as wide as the widest hook (stride_t); a site reads
                        # its first `hidden` columns. Flags: bit 0 gate, bit 1 keep row.
                        w = tl.load(w_ptr + entry * stride_t + offs, mask=mask, other=0.0)
                        if (gated & 1) != 0:
                            g = tl.load(gate_ptr + entry * stride_t + offs, mask=mask, other=0.0)
                            if kind == 1 and HAS_RES:
                                r = tl.load(r_ptr + row * stride_r + offs, mask=mask,
                                            other=0.0).to(tl.float32)
                                score = score + tl.sum((x + r) * g, axis=0)
                            else:
                                score = score + tl.sum(x * g, axis=0)
                        if score > 0.0:
                            if alpha != 0.0:
                                u = tl.load(u_ptr + entry * stride_t + offs, mask=mask,
                                            other=0.0)
                                if kind == 1 and HAS_RES:
                                    r = tl.load(r_ptr + row * stride_r + offs, mask=mask,
                                                other=0.0).to(tl.float32)
                                    proj = tl.sum((x + r) * u, axis=0)
                                else:
                                    proj = tl.sum(x * u, axis=0)
                                if (gated & 2) != 0:  # a selection (selections.py)
                                    x = x * tl.load(keep_ptr + entry * stride_t + offs,
                                                    mask=mask, other=0.0)
                                x = x + alpha * proj * u
                            elif (gated & 2) != 0:
                                x = x * tl.load(keep_ptr + entry * stride_t + offs, mask=mask,
                                                other=0.0)
                            x = (x + w).to(DTYPE).to(tl.float32)
                            tl.store(x_ptr + row * stride_x + offs, x.to(DTYPE), mask=mask)
                    if prank >= 0:  # a patch sets the value, after the steering
                        pbase = tl.load(pbase_ptr + (slot * 2 + kind) * num_sites + site)
                        if pbase >= 0:
                            keep = tl.load(pkeep_ptr + pbase + prank)
                            if keep != 0:
                                v = tl.load(pvalues_ptr + (pbase + prank) * hidden + offs,
                                            mask=mask, other=0.0)
                                if kind == 1 and HAS_RES:
                                    r = tl.load(r_ptr + row * stride_r + offs, mask=mask,
                                                other=0.0).to(tl.float32)
                                    v = v - r
                                x = v.to(DTYPE).to(tl.float32)
                                tl.store(x_ptr + row * stride_x + offs, x.to(DTYPE),
                                         mask=mask)
                    if (base >= 0) & (rank >= 0):
                        if kind == 1 and HAS_RES:
                            r = tl.load(r_ptr + row * stride_r + offs, mask=mask,
                                        other=0.0).to(tl.float32)
                            val = (x + r).to(DTYPE)
                        else:
                            val = x.to(DTYPE)
                        tl.store(staging_ptr + (base + rank) * stride_s + offs, val, mask=mask)


    # One compiled variant for every batch: the sizes are never specialised, and the
    # pointers are fixed buffers (a compile in the middle of serving would stall a step).
    @triton.jit(do_not_specialize=["num_reqs", "n_rows"])
    def _expand(index_ptr, slot_out_ptr, gen_out_ptr, num_reqs, n_rows, BLOCK: tl.constexpr,
                STEPS: tl.constexpr):
        """index = [ends (num_reqs) | slots (num_reqs + 1) | first generated rows (same)].
        Per row: its batch index b (the number of requests ending at or before it, by
        binary search over the ends), slot = slots[b], class = row >= first_gen[b]."""
        rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        live = rows < n_rows
        lo = tl.zeros([BLOCK], dtype=tl.int32)
        hi = tl.zeros([BLOCK], dtype=tl.int32) + num_reqs
        for _ in tl.static_range(STEPS):  # 2**STEPS > the most requests a batch can hold
            open_ = lo < hi
            mid = (lo + hi) // 2
            end = tl.load(index_ptr + mid, mask=live & open_, other=0)
            right = open_ & (end <= rows)
            lo = tl.where(right, mid + 1, lo)
            hi = tl.where(open_ & ~right, mid, hi)
        slot = tl.load(index_ptr + num_reqs + lo, mask=live, other=0)
        first_gen = tl.load(index_ptr + 2 * num_reqs + 1 + lo, mask=live, other=0)
        tl.store(slot_out_ptr + rows, slot, mask=live)
        tl.store(gen_out_ptr + rows, (rows >= first_gen).to(tl.int64), mask=live)


def expand_rows(index: torch.Tensor, num_reqs: int, slot_out: torch.Tensor,
                gen_out: torch.Tensor, max_rows: int) -> None:
    """slot_out[r] = slots[b], gen_out[r] = r >= first_gen[b] for every row r of the
    outputs, b = the number of ends <= r, from `index` laid out as `_expand` reads it
    (one launch; the runtime's torch path does the same in four). `max_rows` bounds the
    requests of a batch (it fixes the search depth)."""
    n = slot_out.shape[0]
    if n == 0:
        return
    block = 1024
    _expand[(triton.cdiv(n, block),)](index, slot_out, gen_out, num_reqs, n, BLOCK=block,
                                      STEPS=max(1, int(max_rows).bit_length()))


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
        runtime.point_base, runtime.u, runtime.w, runtime.alpha, runtime.gate, runtime.gate_b,
        runtime.gated, runtime.keep, runtime.staging, *_patch_buffers(runtime), site,
        runtime.num_sites, hidden, x.stride(0), res.stride(0), runtime.staging.stride(0),
        runtime.u.stride(0), HAS_RES=consts[0], KINDS=consts[1], DTYPE=consts[2], BLOCK=consts[3])
    if runtime.tap_direct and all(hasattr(kernel, a) for a in ("run", "function",
                                                             "packed_metadata")):
        fixed = tuple(t.data_ptr() for t in (
            runtime.tok_slot, runtime.tok_gen, runtime.tok_rank, runtime.slot_entry,
            runtime.point_base, runtime.u, runtime.w, runtime.alpha, runtime.gate,
            runtime.gate_b, runtime.gated, runtime.keep, runtime.staging,
            *_patch_buffers(runtime)))
        runtime.tap_launchers[key] = (kernel.run, kernel.function, kernel.packed_metadata,
                                      torch.cuda.current_device(), fixed,
                                      (runtime.staging.stride(0), runtime.u.stride(0), *consts))


def _patch_buffers(runtime) -> tuple[torch.Tensor, ...]:
    """The patch table's per-row ranks, bases, values and keep flags (patches.DeviceTable)."""
    table = runtime.patch_table
    return table.rank, table.base, table.values, table.keep


def _raw_stream(device_index: int) -> int:
    return torch._C._cuda_getCurrentRawStream(device_index)
