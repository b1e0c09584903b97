"""The applications built on the library, kept apart from it: the character-level language model
(``lm``) and its training loop (``train``, the main job), the layer's gradient check (``check``),
the timing demo (``demo``) and the benchmarks (``bench``, ``bench_qwen3_next``). Each is a
subcommand of ``python -m gdn_ext``; they need the ``apps`` extra (tqdm, threadpoolctl; the
benchmarks' torch rows need torch)."""
