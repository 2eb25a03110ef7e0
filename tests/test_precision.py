"""Lesson 16: formats, master weights, the dynamic loss scaler beside torch.amp.GradScaler, memory
per parameter (one process and ZeRO in mixed precision on real ranks), recomputation, FP8 scaling,
the bf16 all-reduce, the exercise's checker, and bad input refused before ranks start."""

from __future__ import annotations

import pytest
import torch

from pipelab import exercises
from pipelab.experiments import precision as px
from pipelab.experiments import precision_parts as pp
from pipelab.experiments import run
from pipelab.precision import (FORMATS, DelayedScaling, DynamicLossScaler, MasterWeights, MixedZero, amax,
                               bytes_per_parameter, rounding_effect, scale_for)

CFG = px.Config(steps=12, zero_world_sizes=(2,))


def test_formats_read_from_finfo():
    assert FORMATS["bf16"].mantissa_bits == 7 and FORMATS["bf16"].exponent_bits == 8
    assert FORMATS["fp16"].max == 65504 and FORMATS["fp16"].mantissa_bits == 10
    assert FORMATS["fp8 e4m3"].max == 448 and FORMATS["fp8 e4m3"].mantissa_bits == 3
    assert FORMATS["fp16"].smallest_subnormal == pytest.approx(2.0 ** -24)
    tiny = torch.full((10,), 1e-8)
    assert rounding_effect(tiny, torch.float16)["underflow to zero"] == 1.0
    assert rounding_effect(tiny, torch.bfloat16)["underflow to zero"] == 0.0


def test_master_weights_keep_updates_bf16_rounds_away():
    model = torch.nn.Linear(4, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(1.0)
    trainer = MasterWeights(model, lambda p: torch.optim.SGD(p, lr=1e-3))
    for _ in range(10):
        model.weight.grad = torch.ones_like(model.weight)
        trainer.step()
    assert trainer.master[0][0, 0].item() == pytest.approx(1 - 1e-2, rel=1e-5)
    assert model.weight.dtype == torch.bfloat16 and model.weight[0, 0].item() != 1.0  # the masters moved it
    alone = torch.tensor(1.0, dtype=torch.bfloat16)
    assert alone - 1e-3 == alone  # without masters each update rounds away


def test_loss_scaler_update_rule():
    s = DynamicLossScaler(8.0, growth_interval=2)
    s.update(True)
    assert (s.scale, s.good_steps) == (4.0, 0)
    s.update(False)
    assert (s.scale, s.good_steps) == (4.0, 1)
    s.update(False)
    assert (s.scale, s.good_steps) == (8.0, 0)


def test_curves_agree_within_tolerance_and_our_scaler_is_gradscaler():
    runs = px.curves(CFG)
    assert max(px.agreement(runs).values()) <= CFG.loss_rtol
    key, verdict, text, figures = px.scalers_verdict(runs)
    assert verdict == "equal" and figures["skipped"] >= 1, text  # 2^24 overflows: steps were skipped
    assert runs["fp16 + our scaler"].scales[-1] < CFG.init_scale
    assert px.bitwise_equal_steps(runs)["bf16 autocast"] < CFG.steps


def test_unscaled_fp16_stops_learning_on_small_gradients():
    assert px.zero_gradient_share(CFG) > 0.9 and px.zero_gradient_share(CFG, 2.0 ** 16) < 0.1
    key, verdict, text, kept = px.small_gradients_verdict(px.small_gradients(CFG))
    assert verdict == "scaling needed", text


def test_memory_per_parameter_matches_the_recipes():
    for row in px.memory_rows(CFG):
        assert row["counted total"] == pytest.approx(row["formula total"], abs=0.1), row
    assert sum(bytes_per_parameter("bf16 + fp32 master")) == 16
    with pytest.raises(ValueError, match="recipe must be one of"):
        bytes_per_parameter("fp8")


def test_mixed_precision_zero_on_real_ranks_matches_one_process_and_the_formula():
    rows = px.zero_rows(CFG, px.zero_runs(CFG))
    assert [r["stage"] for r in rows] == ["DP", "ZeRO-1", "ZeRO-2", "ZeRO-3"]
    for r in rows:
        assert 1 <= r["counted B/param"] / r["formula B/param"] < 1.1, r
        assert r["loss vs one process"] < 1e-2 and r["largest master difference"] < 1e-2, r
    sent = {r["stage"]: r["sent per step (B)"] for r in rows}
    assert sent["ZeRO-1"] == sent["ZeRO-2"] == sent["ZeRO-3"] == sent["DP"]  # ZeRO-3 gathers once per step here


def test_recomputation_bytes_match_korthikanti_and_keep_the_gradients():
    rows, same = pp.recompute_rows(pp.BlockSize(64, 2, 32, 4))
    assert same
    for r in rows:
        assert r["counted (bytes/sbh)"] == pytest.approx(r["Korthikanti, no dropout (bytes/sbh)"], rel=0.1), r
    times = pp.recompute_times(pp.BlockSize(2048, 1, 1024, 16))
    overhead = {t["recomputation"]: t["overhead vs none"] for t in times}
    assert 0 < overhead["selective"] < overhead["full"]
    assert pp.recompute_verdict(rows, times)[1] == "selective cheaper"


def test_fp8_scaling():
    torch.manual_seed(0)
    a, b = torch.randn(32, 64) * 1e-3, torch.randn(64, 16)
    errors = pp.fp8_errors(a, b)
    assert errors["bf16"] < errors["fp8 e4m3, per-tensor scale"] < 0.1 < errors["fp8 e4m3, no scale"]
    assert scale_for(amax(torch.tensor([2.0, -4.0]))).item() == 112.0
    delayed = DelayedScaling(history=2)
    assert delayed.scale(torch.tensor([4.0])).item() == 112.0  # no history yet: the tensor's own amax
    assert delayed.scale(torch.tensor([8.0])).item() == 112.0  # the history's amax, not the new one
    rows = pp.scaling_over_steps([torch.ones(8) * (4.0 if t == 3 else 1.0) for t in range(5)], history=2)
    assert rows[3]["delayed saturated"] == 1.0 and rows[3]["current saturated"] == 0.0
    rates = pp.fp8_rates((8192, 8192, 8192))
    assert rates["fp8 product (us, modelled)"] < rates["bf16 product (us, modelled)"]
    small = pp.fp8_rates((1024, 1024, 1024))  # launch-bound on the calibrated H100: FP8 gains nothing
    assert small["fp8 product (us, modelled)"] == small["bf16 product (us, modelled)"]
    model, (x, y) = CFG.model(), CFG.data()
    pairs = pp.lesson_matrices(model, x, y)
    rows = {r["product"]: r for r in pp.fp8_rows(pairs)}
    backward = rows["backward: output gradient @ weight"]
    assert float(backward["fp8 e4m3, no scale"]) > 5 * float(backward["fp8 e4m3, per-tensor scale"])


def test_bf16_all_reduce_halves_the_bytes():
    acfg = px.Config(world_size=2, numel=1024)
    results = run(pp.allreduce_worker, acfg)
    key, verdict, text, figures = pp.allreduce_verdict(results, acfg)
    assert figures["ratio"] == 0.5 and 0 < figures["error_bf16"] < 2 ** -7, text
    # counted per call as a ring all-reduce sends: 2 (n-1)/n of the tensor, 4 then 2 bytes a value
    assert (results[0].bytes_fp32, results[0].bytes_bf16) == (2 * 1 / 2 * 1024 * 4, 2 * 1 / 2 * 1024 * 2)


def test_bad_input_is_refused_before_ranks_start():
    with pytest.raises(ValueError, match="batch=30 does not split over 4 ranks"):
        px.Config(batch=30, zero_world_sizes=(4,))
    with pytest.raises(ValueError, match="steps"):
        px.Config(steps=0)
    with pytest.raises(ValueError, match="dim=66 does not divide"):
        pp.BlockSize(128, 2, 66, 4)
    with pytest.raises(ValueError, match="stage must be"):
        MixedZero(None, None, stage=4)
    with pytest.raises(ValueError, match="numel"):
        px.Config(numel=-1)


# ---- the exercise: its solution, another correct answer, and wrong ones named ---------------------


def update_written_otherwise(scale, good_steps, found_inf, growth_interval):
    if not found_inf and good_steps + 1 < growth_interval:
        return scale, good_steps + 1
    return (scale / 2 if found_inf else scale * 2), 0


def doubles_on_overflow(scale, good_steps, found_inf, growth_interval):
    if found_inf:
        return scale * 2, 0
    return (scale * 2, 0) if good_steps + 1 == growth_interval else (scale, good_steps + 1)


def keeps_count_on_overflow(scale, good_steps, found_inf, growth_interval):
    if found_inf:
        return scale / 2, good_steps
    return (scale * 2, 0) if good_steps + 1 == growth_interval else (scale, good_steps + 1)


def grows_one_step_late(scale, good_steps, found_inf, growth_interval):
    if found_inf:
        return scale / 2, 0
    return (scale * 2, 0) if good_steps + 1 > growth_interval else (scale, good_steps + 1)


def never_resets_after_growth(scale, good_steps, found_inf, growth_interval):
    if found_inf:
        return scale / 2, 0
    good_steps += 1
    return (scale * 2 if good_steps >= growth_interval else scale), good_steps


def returns_the_scale_only(scale, good_steps, found_inf, growth_interval):
    return scale / 2 if found_inf else scale


def test_the_exercise_passes_its_solution_and_another_correct_answer():
    assert exercises.check_loss_scale_update(exercises.solution("16_loss_scale_update"), quiet=True).passed
    assert exercises.check_loss_scale_update(update_written_otherwise, quiet=True).passed


def forgets_to_halve(scale, good_steps, found_inf, growth_interval):
    if found_inf:
        return scale, 0
    return (scale * 2, 0) if good_steps + 1 == growth_interval else (scale, good_steps + 1)


def skips_the_step_count_on_growth(scale, good_steps, found_inf, growth_interval):
    if found_inf:
        return scale / 2, 0
    return (scale * 2, 0) if good_steps + 1 == growth_interval else (scale * 1.0, good_steps)


RIGHT_ANSWERS = [update_written_otherwise]
WRONG_ANSWERS = [
    (doubles_on_overflow, "you doubled the scale"),
    (keeps_count_on_overflow, "must start again at 0"),
    (grows_one_step_late, "you grow one step late"),
    (never_resets_after_growth, "reset it to 0"),
    (returns_the_scale_only, "return the pair"),
    (forgets_to_halve, "turned scale 1024 into 1024: halve it"),
    (skips_the_step_count_on_growth, "left the count at 1: count it"),
]


@pytest.mark.parametrize("wrong, expected", WRONG_ANSWERS)
def test_wrong_answers_fail_naming_the_mistake(wrong, expected):
    grade = exercises.check_loss_scale_update(wrong, quiet=True)
    assert not grade.passed and expected in grade.message, grade.message
