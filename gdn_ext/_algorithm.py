"""Which form of the computation a call runs: the recurrence (token by token) or the chunkwise
form (the WY / UT-transform representation, chunks of C tokens as small matrix products).

Both compute the same function; they differ in rounding and speed. ``algorithm="auto"`` picks by
the rule in `chunk_for`, whose thresholds were measured (docs, "Speed"). Pure Python: the torch
front end resolves the choice from tensor sizes with the same rule.

Source of the chunkwise form: S. Yang, B. Wang, Y. Zhang, Y. Shen, Y. Kim, "Parallelizing Linear
Transformers with the Delta Rule over Sequence Length", NeurIPS 2024 (arXiv:2406.06484), sec. 3.
"""
import operator

ALGORITHMS = ("auto", "chunk", "recurrent")
DEFAULT_CHUNK_SIZE = 32   # measured: 32 and 64 within a few percent, 16 slower (docs, "Speed")
MAX_CHUNK_SIZE = 256      # the compiled module's GDN_CHUNK_MAX
# auto: the chunkwise form for sequences at least this long (shorter ones: the recurrence, which
# has no per-chunk set-up and decodes a token without padding it to a chunk)
AUTO_MIN_LEN = 64
# auto: the recurrence when some beta_t ||k_t||^2 exceeds this (keys not normalised): the UT
# transform's triangular solve then amplifies rounding (its condition grows like the product of
# the (1 + beta ||k||^2) factors of a chunk), while the recurrence stays as accurate as the state
AUTO_MAX_BETA_K2 = 2.0


def check_algorithm(algorithm, chunk_size):
    """The ``algorithm`` and ``chunk_size`` arguments checked: (algorithm, chunk_size or None).
    TypeError for a non-string algorithm or a non-int chunk_size, ValueError for an unknown
    algorithm or a chunk_size outside [1, MAX_CHUNK_SIZE]."""
    if not isinstance(algorithm, str):
        raise TypeError(f"algorithm must be one of {', '.join(map(repr, ALGORITHMS))}; got "
                        f"{algorithm!r}")
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {', '.join(map(repr, ALGORITHMS))}; got "
                         f"{algorithm!r}")
    if chunk_size is None:
        return algorithm, None
    if isinstance(chunk_size, bool):
        raise TypeError("chunk_size must be None or a positive int; got a bool")
    try:
        c = operator.index(chunk_size)
    except TypeError:
        raise TypeError(f"chunk_size must be None or a positive int; got "
                        f"{type(chunk_size).__name__}") from None
    if not 1 <= c <= MAX_CHUNK_SIZE:
        raise ValueError(f"chunk_size must be None or an int in [1, {MAX_CHUNK_SIZE}]; got {c}")
    return algorithm, c


def chunk_for(algorithm, chunk_size, *, per_key, max_len, beta_k2=None):
    """The chunk size a call runs with, 0 for the recurrence.

    "recurrent": 0. "chunk": chunk_size (DEFAULT_CHUNK_SIZE when None), except for a gate per
    key channel, which has no chunkwise kernel (0). "auto": the chunkwise form when the gate is
    one number per token, the longest sequence has at least AUTO_MIN_LEN tokens and, when
    ``beta_k2`` (the largest beta_t ||k_t||^2, None when keys are normalised) is given, it is at
    most AUTO_MAX_BETA_K2 (a well-conditioned UT transform); else 0."""
    if algorithm == "recurrent" or per_key:
        return 0
    C = DEFAULT_CHUNK_SIZE if chunk_size is None else chunk_size
    if algorithm == "chunk":
        return C
    if max_len < AUTO_MIN_LEN:
        return 0
    if beta_k2 is not None and not beta_k2 <= AUTO_MAX_BETA_K2:   # NaN: the recurrence
        return 0
    return C
