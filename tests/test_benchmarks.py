"""The benchmark scripts still run and still compare equal models (their correctness guards)."""

from __future__ import annotations

import pytest

from script_modules import load_script


def _load(name: str):
    return load_script(f"benchmarks/{name}.py")


@pytest.mark.slow  # runs the benchmark: about 2.5 s
def test_sat_train_benchmark_baseline_computes_the_same_loss():
    # sat_train raises when the tutorial-style baseline and the decoder disagree on the loss, so
    # this also pins the baseline's penalty form to the one the benchmark asks the loss for
    figures = _load("bench_sat").sat_train(quick=True)
    assert figures["device"] == "cpu"
    assert figures["captions_per_s"] > 0 and figures["baseline_captions_per_s"] > 0


@pytest.mark.slow  # builds the Lite0 model and serves it: about 10 s
def test_serve_benchmark_runs_and_reports_percentiles():
    pytest.importorskip("fastapi")
    figures = _load("bench_serve").serve_latency(quick=True)
    assert figures["requests"] == 5 and figures["words"] == 20  # untrained decoder: full-length captions
    assert 0 < figures["server_p50_seconds"] <= figures["p50_seconds"] <= figures["p95_seconds"]


@pytest.mark.slow  # a server process under 4 uploads of 2000x2000 16-bit PNGs and 10 slow connections: about 25 s
def test_serve_crowd_benchmark_stays_within_its_bounds():
    pytest.importorskip("fastapi")
    figures = _load("bench_serve").serve_crowd(quick=True)
    assert figures["statuses"] == "200x4" and figures["real_ok"] == figures["real_requests"] > 0
    assert figures["peak_rss_gb"] < 2.0 and figures["rest_rss_gb"] < 1.0
    assert figures["slow_closed"] == figures["slow_connections"]  # the head deadline closed every one
    assert figures["real_max_seconds"] < 2.0


@pytest.mark.slow  # 8 photos of each set through both paths and the cache
def test_caption_throughput_benchmark_runs_both_paths_and_restores_the_encoder():
    module = _load("bench_throughput")
    figures = module.caption_throughput(quick=True, photos=8)
    assert figures["photos"] == 8 and figures["model"]
    for key in ("caption_coco_per_s", "caption_bf16_coco_per_s", "before_coco_per_s", "bound_coco_per_s", "cache_per_s",
                "cache_before_per_s", "caption_lm_coco_per_s",  # the shipped model: the packaged LM fits it
                "caption_int8_coco_per_s", "bound_int8_small_per_s"):  # and its int8 calibration ships
        assert figures[key] > 0, key
    m, _ = module._model()  # the "before" switch is undone: the encoder is channels-last and folds again
    with module._before(m):
        assert not m.model.encoder.fold_batchnorm
    assert m.model.encoder.fold_batchnorm and m.model.encoder.memory_format is None
    assert m.model.encoder.int8_trunk is None and m.precision == "float32"  # the float rows stay float
