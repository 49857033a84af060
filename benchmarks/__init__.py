"""Side-by-side benchmarks of torch_dplr against flash-linear-attention (issue 4).

``python -m torch_dplr bench`` (or ``python -m benchmarks.harness``) times both libraries in one
process on the same inputs and writes JSON lines, a markdown table and a PNG of the ratios;
``python -m benchmarks.report`` turns a JSON-lines file into the table and the plot again.

Modules: :mod:`~benchmarks.cells` (the envelope), :mod:`~benchmarks.inputs` (device-side
inputs), :mod:`~benchmarks.timing` (CUDA events, L2 flush, peak memory),
:mod:`~benchmarks.fla_routes` (FLA's Triton and TileLang routes), :mod:`~benchmarks.first_call`
(cold and warm first call, run as a subprocess), :mod:`~benchmarks.stages` (torch_dplr's stage
ops timed one by one: time, bytes, bandwidth), :mod:`~benchmarks.harness` (the CLI) and
:mod:`~benchmarks.report`.
"""
