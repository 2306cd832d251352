"""The ground floor: what every layer above uses and which imports nothing of coda_lang.

- diagnostics.py: source spans, error codes, `Diagnostic`, `CodaError` and `error()` (the one way to
  make a located error), their renderings;
- numerics.py: dtypes and rounding (the interpreter's and the references' f32/bf16/f16 rules);
- progress.py: the progress line of long work (compiles, tuning, `coda fuzz`).
"""

VERSION = "0.1.0"  # coda_lang.__version__; part of every kernel cache key
