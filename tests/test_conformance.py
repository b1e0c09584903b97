"""The conformance suite tested on itself: gdn_ext's drop-ins and transformers' fallbacks pass,
and implementations with a real bug kind each fail at least one case."""
import json
import os

import pytest

if os.environ.get("GDN_EXT_REQUIRE_TORCH") == "1":
    import torch
else:
    torch = pytest.importorskip("torch")

import gdn_ext.torch as gt  # noqa: E402
from gdn_ext import conformance  # noqa: E402


def loop_rule(q, k, v, g=None, beta=None, scale=None, initial_state=None,
              output_final_state=False, use_qk_l2norm_in_kernel=False, cu_seqlens=None, *,
              gk=None, bug=None):
    """A plain torch loop in flash-linear-attention's convention, right unless `bug` names one
    of the bug kinds the suite must catch."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    G = HV // H
    dt = torch.float64 if q.dtype == torch.float64 else torch.float32
    q, k, v, beta = q.to(dt), k.to(dt), v.to(dt), beta.to(dt)
    logd = (g.to(dt)[..., None] if g is not None else 0) + (gk.to(dt) if gk is not None else 0)
    logd = logd.expand(B, T, HV, K) if torch.is_tensor(logd) else torch.zeros(B, T, HV, K,
                                                                               dtype=dt)
    if scale is None:
        scale = K ** -0.5
    if use_qk_l2norm_in_kernel:
        if bug == "eps outside the root":
            q = q / (q.norm(dim=-1, keepdim=True) + 1e-6)
            k = k / (k.norm(dim=-1, keepdim=True) + 1e-6)
        else:
            q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
            k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    heads = (torch.arange(HV) % H) if bug == "tiled head order" else (torch.arange(HV) // G)
    q, k = q[:, :, heads], k[:, :, heads]
    bounds = [(0, T)] if cu_seqlens is None else list(zip(cu_seqlens[:-1].tolist(),
                                                          cu_seqlens[1:].tolist()))
    outs, finals = [], []
    for n, (a, b) in enumerate(bounds):
        N = B if cu_seqlens is None else 1
        if initial_state is None or bug == "initial state ignored":
            S = torch.zeros(N, HV, K, V, dtype=dt)
        else:
            S = initial_state.to(dt) if cu_seqlens is None else initial_state[n:n + 1].to(dt)
            if bug == "transposed state":
                S = S.reshape(N, HV, V, K).transpose(-1, -2) if K == V else S.transpose(-1, -2)
        end = b
        if bug == "final state from a padded chunk":
            end = a + -(-(b - a) // 64) * 64     # runs on through padding: the last token again
        for t in range(a, end):
            s = min(t, b - 1)
            alpha = logd[:, s].exp()[..., None]                          # [B, HV, K, 1]
            if bug == "decay after the correction":
                u = beta[:, s, :, None] * (v[:, s] - torch.einsum("bhkv,bhk->bhv", S, k[:, s]))
                S = alpha * (S + k[:, s][..., None] * u[..., None, :])
            else:
                S = alpha * S
                u = beta[:, s, :, None] * (v[:, s] - torch.einsum("bhkv,bhk->bhv", S, k[:, s]))
                S = S + k[:, s][..., None] * u[..., None, :]
            if t < b:
                outs.append(scale * torch.einsum("bhkv,bhk->bhv", S, q[:, s]))
        finals.append(S)
    o = torch.stack(outs, 1) if outs else v.new_zeros(v.shape).to(dt)
    S_T = torch.cat(finals, 0)
    if bug == "transposed state":
        S_T = S_T.transpose(-1, -2)
    return o, (S_T if output_final_state else None)


def _with_bug(bug):
    def fn(q, k, v, g=None, beta=None, scale=None, initial_state=None, output_final_state=False,
           use_qk_l2norm_in_kernel=False, cu_seqlens=None, *, gk=None):
        return loop_rule(q, k, v, g, beta, scale, initial_state, output_final_state,
                         use_qk_l2norm_in_kernel, cu_seqlens, gk=gk, bug=bug)
    return fn


FAST = [c for c in conformance.CASES if c.name not in ("long", "T=127", "T=129")]


def test_the_correct_loop_passes():
    report = conformance.run(_with_bug(None), "fla", "float64", cases=FAST)
    assert report.passed, report.table()


@pytest.mark.parametrize("bug", ["decay after the correction", "tiled head order",
                                 "eps outside the root", "final state from a padded chunk",
                                 "initial state ignored", "transposed state"])
def test_each_bug_kind_is_caught(bug):
    report = conformance.run(_with_bug(bug), "fla", "float64", cases=FAST)
    assert not report.passed, report.table()
    failed = [r["case"] for r in report.rows if r["status"] in ("FAIL", "error")]
    assert failed, report.table()


@pytest.mark.parametrize("fn", [gt.chunk_gated_delta_rule, gt.fused_recurrent_gated_delta_rule])
def test_gdn_ext_dropins_pass(fn):
    report = conformance.run(fn, "fla", "float32")
    assert report.passed, report.table()
    assert not any(r["status"] == "skip" for r in report.rows)


def test_gdn_ext_convention_and_transformers_fallbacks():
    own = conformance.run(gt.gated_delta_rule, "gdn_ext", "float64")
    assert own.passed, own.table()
    # every case runs, the bfloat16 and float16 ones included (one dtype story for torch)
    assert not any(r["status"] == "skip" for r in own.rows), own.table()
    q3 = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    report = conformance.run(q3.torch_recurrent_gated_delta_rule, "transformers", "float32",
                             cases=FAST)
    assert report.passed, report.table()
    skipped = {r["case"] for r in report.rows if r["status"] == "skip"}
    assert skipped == {"packed", "per-key decay", "beta in (1,2)"}


def test_command_line(tmp_path, capsys):
    from gdn_ext.__main__ import main
    out = tmp_path / "r.json"
    assert main(["conformance", "gdn_ext.torch:fused_recurrent_gated_delta_rule",
                 "--no-progress", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "passed, 0 failed" in text
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == len(conformance.CASES)
    with pytest.raises(SystemExit):
        main(["conformance", "no_such_module_xyz:fn"])


def _detached(q, k, v, g=None, beta=None, **kw):
    o, S = gt.chunk_gated_delta_rule(q, k, v, g, beta, **kw)
    return o.detach(), S.detach()


def _o_detached(q, k, v, g=None, beta=None, **kw):
    o, S = gt.chunk_gated_delta_rule(q, k, v, g, beta, **kw)
    return o.detach(), S


def _state_detached(q, k, v, g=None, beta=None, **kw):
    o, S = gt.chunk_gated_delta_rule(q, k, v, g, beta, **kw)
    return o, S.detach()


class _NoBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, o):
        return o.clone()

    @staticmethod
    def backward(ctx, do):
        raise NotImplementedError("this kernel has no backward")


def _no_backward(q, k, v, g=None, beta=None, **kw):
    o, S = gt.chunk_gated_delta_rule(q, k, v, g, beta, **kw)
    return _NoBackward.apply(o), _NoBackward.apply(S)


def _zero_gradients(q, k, v, g=None, beta=None, **kw):
    o, S = gt.chunk_gated_delta_rule(q, k, v, g, beta, **kw)
    tie = sum(0 * x.sum() for x in (q, k, v, g, beta))   # connected, with zero gradients
    return o.detach() + tie, S.detach() + tie


@pytest.mark.parametrize("target", [_detached, _o_detached, _state_detached, _no_backward,
                                    _zero_gradients])
def test_a_target_with_missing_gradients_fails(target):
    """A correct forward whose gradients are missing -- detached outputs, one of the two
    detached, a backward that raises NotImplementedError, outputs tied to the inputs with zero
    gradients -- fails every case that has gradients to compare: a disconnected backward must
    never pass as "forward only"; the row's note says which gradients are missing."""
    report = conformance.run(target, "fla", "float32", cases=["T=1", "T=65", "repeatable"])
    assert not report.passed, report.table()
    assert all(r["status"] in ("FAIL", "error") for r in report.rows), report.table()
    if target is _zero_gradients:
        assert "no gradient (None or all zeros) for q, k, v" in report.rows[0]["note"]


def test_forward_only_is_asked_for_and_said():
    """forward_only=True checks the output and the final state only: a forward-only kernel
    passes, with "fwd" rows and the header saying so; the gradient-only case is skipped; a wrong
    forward still fails."""
    report = conformance.run(_no_backward, "fla", "float32", cases=["T=1", "repeatable"],
                             forward_only=True)
    assert report.passed, report.table()
    assert [r["status"] for r in report.rows] == ["fwd", "skip"]
    assert "forward only: gradients not checked" in report.table().splitlines()[0]
    assert "1 on the forward only" in report.table()
    wrong = conformance.run(_with_bug("initial state ignored"), "fla", "float64", cases=FAST,
                            forward_only=True)
    assert not wrong.passed, wrong.table()


def test_a_report_of_skips_alone_does_not_pass():
    """Nothing checked is nothing certified: a target that lacks every feature the asked cases
    need skips them all and its report does not pass."""
    def no_packing(q, k, v, g=None, beta=None, scale=None, initial_state=None,
                   output_final_state=True):
        return gt.chunk_gated_delta_rule(q, k, v, g, beta, scale=scale,
                                         initial_state=initial_state,
                                         output_final_state=output_final_state)

    report = conformance.run(no_packing, "fla", "float32", cases=["packed"])
    assert [r["status"] for r in report.rows] == ["skip"]
    assert not report.passed, report.table()


def test_targets_without_gradients_or_malformed():
    """A non-callable is refused; a target that returns the wrong thing errors with a message
    that says what came back; JSON output is strict."""
    detached = _detached
    with pytest.raises(TypeError, match="callable"):
        conformance.run(3, "fla")
    with pytest.raises(ValueError, match="unknown case"):
        conformance.run(detached, "fla", cases=["T=2"])

    def only_o(q, k, v, g=None, beta=None, **kw):
        return gt.chunk_gated_delta_rule(q, k, v, g, beta, **kw)[0]

    report = conformance.run(only_o, "fla", "float32", cases=["T=1"])
    assert report.rows[0]["status"] == "error" and "must return (o, final_state)" in \
        report.rows[0]["note"]


def test_command_line_forward_only(capsys):
    """--forward-only on the command line: a forward-only kernel passes only with it."""
    from gdn_ext.__main__ import main
    assert main(["conformance", "test_conformance:_no_backward", "--no-progress"]) == 1
    assert main(["conformance", "test_conformance:_no_backward", "--no-progress",
                 "--forward-only"]) == 0
    assert "forward only: gradients not checked" in capsys.readouterr().out


def test_json_is_strict(tmp_path):
    from gdn_ext.__main__ import main
    out = tmp_path / "r.json"
    assert main(["conformance", "test_conformance:broken_for_json", "--no-progress",
                 "--json", str(out)]) == 1
    json.loads(out.read_text(), parse_constant=lambda c: pytest.fail(f"non-standard {c}"))


def broken_for_json(q, k, v, g=None, beta=None, **kw):
    o, S = gt.chunk_gated_delta_rule(q, k, v, g, beta, **kw)
    return o * float("inf"), S
