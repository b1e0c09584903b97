"""gdn_ext.torch.GatedDeltaNet with attention_mask: padding is neutral.

A masked token changes neither the recurrent nor the convolution state, wherever it sits and
whatever it holds; each row of a padded batch gives, at its real tokens and in its returned state,
what that row's real tokens give run alone without a mask (the reference: the same layer's
unmasked path, itself checked against transformers' layer in test_torch_interop.py)."""
import os

import pytest

if os.environ.get("GDN_EXT_REQUIRE_TORCH") == "1":
    import torch
else:
    torch = pytest.importorskip("torch")

import gdn_ext.torch as gt  # noqa: E402

D, HK, HV, K, V = 32, 2, 4, 8, 6

# one row per case; T = 8
ROWS = {
    "unpadded": [1, 1, 1, 1, 1, 1, 1, 1],
    "right": [1, 1, 1, 1, 1, 0, 0, 0],
    "left": [0, 0, 0, 1, 1, 1, 1, 1],
    "interior": [1, 0, 0, 1, 1, 0, 1, 1],
    "one_real": [0, 0, 0, 1, 0, 0, 0, 0],      # fewer real tokens than kernel - 1
    "all_padded": [0, 0, 0, 0, 0, 0, 0, 0],
}


def _layer(dtype=torch.float64, kernel=4, seed=0):
    torch.manual_seed(seed)
    layer = gt.GatedDeltaNet(D, HK, HV, K, V, conv_kernel_size=kernel, dtype=dtype)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
        layer.A_log.copy_(torch.linspace(-2, 1, HV, dtype=dtype))
    return layer


def _rand(*shape, dtype=torch.float64, seed=0):
    return torch.randn(*shape, dtype=dtype, generator=torch.Generator().manual_seed(seed))


def _state(layer, B, dtype=torch.float64, seed=1):
    return gt.GatedDeltaNetState(_rand(B, layer.conv_dim, layer.conv_kernel_size - 1,
                                       dtype=dtype, seed=seed),
                                 _rand(B, HV, K, V, dtype=dtype, seed=seed + 1))


def _row_state(state, b):
    return None if state is None else gt.GatedDeltaNetState(state.conv[b:b + 1],
                                                            state.recurrent[b:b + 1])


def _close(got, want, tol):
    scale = max(float(want.abs().max()), 1.0) if want.numel() else 1.0
    torch.testing.assert_close(got, want, rtol=tol, atol=tol * scale)


def _check_rows(layer, x, keep, state, y, new, tol):
    """Each row against its real tokens run alone, unpadded; zeros at the padded positions."""
    for b in range(x.shape[0]):
        with torch.no_grad():
            y_b, st_b = layer(x[b:b + 1, keep[b]], _row_state(state, b))
        _close(y[b, keep[b]], y_b[0], tol)
        _close(new.conv[b], st_b.conv[0], tol)
        _close(new.recurrent[b], st_b.recurrent[0], tol)
        assert torch.equal(y[b, ~keep[b]], torch.zeros_like(y[b, ~keep[b]]))
        if not keep[b].any():          # nothing real: both states exactly as they came in
            before = _row_state(state, b) or gt.GatedDeltaNetState(
                torch.zeros_like(new.conv[b:b + 1]), torch.zeros_like(new.recurrent[b:b + 1]))
            assert torch.equal(new.conv[b], before.conv[0])
            assert torch.equal(new.recurrent[b], before.recurrent[0])


@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.int64, torch.float32])
@pytest.mark.parametrize("start", ["prefill", "carried"])
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 2e-5)])
@pytest.mark.parametrize("kernel", [4, 2])
def test_padded_rows_equal_rows_alone(start, mask_dtype, dtype, tol, kernel):
    """Right, left, interior padding, a row with one real token and a fully padded row, from a
    zero state (prefill) and from a carried state (continuation)."""
    layer = _layer(dtype, kernel)
    keep = torch.tensor(list(ROWS.values()), dtype=torch.bool)
    B, T = keep.shape
    x = _rand(B, T, D, dtype=dtype, seed=2)
    state = None if start == "prefill" else _state(layer, B, dtype)
    mask = keep.to(mask_dtype)
    x_before, mask_before = x.clone(), mask.clone()
    with torch.no_grad():
        y, new = layer(x, state, attention_mask=mask)
    assert torch.equal(x, x_before) and torch.equal(mask, mask_before)   # inputs untouched
    _check_rows(layer, x, keep, state, y, new, tol)


def test_whatever_padded_positions_hold_never_leaks():
    """NaN, inf and huge values at padded positions: the real tokens' outputs and the states are
    those of the rows alone; the outputs at padded positions are zero."""
    layer = _layer()
    keep = torch.tensor([ROWS["right"], ROWS["interior"], ROWS["left"]], dtype=torch.bool)
    x = _rand(3, 8, D, seed=3)
    junk = torch.tensor([float("nan"), float("inf"), -1e300], dtype=x.dtype)
    x_bad = x.clone()
    n = int((~keep).sum())
    x_bad[~keep] = junk[torch.arange(n * D) % 3].view(n, D)
    state = _state(layer, 3)
    with torch.no_grad():
        y, new = layer(x_bad, state, attention_mask=keep)
    assert torch.isfinite(y).all()
    _check_rows(layer, x, keep, state, y, new, 1e-12)


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 2e-5)])
def test_batched_decode_with_finished_rows_masked(dtype, tol):
    """Left-padded prompts of different lengths, then decode steps of one token where rows that
    have finished are masked: a masked step leaves both states bit for bit as they were, and each
    row's outputs and final state are its real tokens' run alone, in one call."""
    layer = _layer(dtype)
    prompt = torch.tensor([ROWS["unpadded"][:6], [0, 0, 1, 1, 1, 1], [0, 0, 0, 0, 0, 1]],
                          dtype=torch.bool)
    steps = 5
    finished_after = [5, 2, 0]                 # decode steps each row takes before it stops
    decode = torch.tensor([[s < n for s in range(steps)] for n in finished_after])
    keep = torch.cat([prompt, decode], 1)
    x = _rand(3, keep.shape[1], D, dtype=dtype, seed=4)
    state = _state(layer, 3, dtype, seed=5)
    ys = []
    with torch.no_grad():
        y, st = layer(x[:, :6], state, attention_mask=prompt)
        ys.append(y)
        for s in range(steps):
            t = 6 + s
            y, new = layer(x[:, t:t + 1], st, attention_mask=decode[:, s:s + 1])
            for b in range(3):
                if not decode[b, s]:
                    assert torch.equal(new.conv[b], st.conv[b])
                    assert torch.equal(new.recurrent[b], st.recurrent[b])
            ys.append(y)
            st = new
    _check_rows(layer, x, keep, state, torch.cat(ys, 1), st, tol)


def test_gradients_equal_rows_alone():
    """Gradients of x, of the carried state and of every parameter through a padded batch are
    those of the rows run alone (summed over the rows for the parameters); zero for padded x.
    A gradcheck of the masked path on a small layer."""
    layer = _layer()
    keep = torch.tensor([ROWS["right"], ROWS["left"], ROWS["interior"], ROWS["one_real"]],
                        dtype=torch.bool)
    B, T = keep.shape
    x = _rand(B, T, D, seed=6).requires_grad_()
    conv0, rec0 = (t.clone().requires_grad_() for t in _state(layer, B))
    w = _rand(B, T, D, seed=7)
    wc = _rand(B, layer.conv_dim, 3, seed=8)
    wr = _rand(B, HV, K, V, seed=9)

    def loss(y, st, rows):
        return (y * w[rows]).sum() + (st.conv * wc[rows]).sum() + (st.recurrent * wr[rows]).sum()

    y, st = layer(x, gt.GatedDeltaNetState(conv0, rec0), attention_mask=keep)
    loss(y, st, slice(None)).backward()
    got = {n: p.grad.clone() for n, p in layer.named_parameters()}
    want = {n: torch.zeros_like(p) for n, p in layer.named_parameters()}
    for b in range(B):
        layer.zero_grad()
        xb = x.detach()[b:b + 1, keep[b]].clone().requires_grad_()
        cb, rb = (t.detach()[b:b + 1].clone().requires_grad_() for t in (conv0, rec0))
        yb, sb = layer(xb, gt.GatedDeltaNetState(cb, rb))
        wb = w[b:b + 1, keep[b]]
        ((yb * wb).sum() + (sb.conv * wc[b:b + 1]).sum()
         + (sb.recurrent * wr[b:b + 1]).sum()).backward()
        _close(x.grad[b, keep[b]], xb.grad[0], 1e-11)
        assert torch.equal(x.grad[b, ~keep[b]], torch.zeros_like(x.grad[b, ~keep[b]]))
        _close(conv0.grad[b], cb.grad[0], 1e-11)
        _close(rec0.grad[b], rb.grad[0], 1e-11)
        for n, p in layer.named_parameters():
            want[n] += p.grad
    for n in got:
        _close(got[n], want[n], 1e-11)

    torch.manual_seed(3)
    small = gt.GatedDeltaNet(6, 1, 2, 3, 2, conv_kernel_size=3, dtype=torch.float64)
    keep = torch.tensor([[1, 0, 1, 1, 0], [0, 0, 1, 0, 1]], dtype=torch.bool)
    inputs = (_rand(2, 5, 6, seed=10), _rand(2, small.conv_dim, 2, seed=11),
              _rand(2, 2, 3, 2, seed=12))

    def fn(x, conv, rec):
        y, st = small(x, gt.GatedDeltaNetState(conv, rec), attention_mask=keep)
        return y, st.conv, st.recurrent

    assert torch.autograd.gradcheck(fn, tuple(t.requires_grad_() for t in inputs))


def test_compiled_masked_layer_equals_rows_alone():
    """Under torch.compile(fullgraph=True) the masked path traces (no data-dependent branch) and
    gives the rows alone."""
    layer = _layer()
    keep = torch.tensor([ROWS["right"], ROWS["left"], ROWS["interior"]], dtype=torch.bool)
    x = _rand(3, 8, D, seed=13)
    state = _state(layer, 3)
    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        y, new = compiled(x, state, attention_mask=keep)
    _check_rows(layer, x, keep, state, y, new, 1e-12)


def test_attention_mask_is_validated():
    """Only [B, T] tensors of bool or 0 / 1 values; a mask of ones is the unmasked path."""
    layer = _layer()
    x = _rand(2, 5, D, seed=14)
    ok = torch.ones(2, 5)
    for bad in (ok * 2, ok * 0.5, -ok, ok * float("nan"), ok.to(torch.complex64)):
        bad = bad.clone()
        bad[0, 0] = 1
        with pytest.raises(ValueError, match="attention_mask must hold bool or 0 / 1"):
            layer(x, attention_mask=bad)
    for bad in (torch.ones(2, 6), torch.ones(2), torch.ones(2, 5, 1), [[1] * 5] * 2):
        with pytest.raises(ValueError, match=r"attention_mask must have shape \[B, T\]"):
            layer(x, attention_mask=bad)
    with torch.no_grad():
        y, st = layer(x)
        for ones in (ok, ok.bool(), ok.long()):
            y1, st1 = layer(x, attention_mask=ones)
            assert torch.equal(y1, y) and torch.equal(st1.conv, st.conv)
            assert torch.equal(st1.recurrent, st.recurrent)
