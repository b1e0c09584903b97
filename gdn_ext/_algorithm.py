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
DEFAULT_CHUNK_SIZE = 32   # a training step, D = 128: 16 takes 1.01-1.04 x its time, 64 1.11-1.14 x
MAX_CHUNK_SIZE = 256      # the compiled module's CHUNK_MAX


def check_algorithm(algorithm, chunk_size):
    """The ``algorithm`` and ``chunk_size`` arguments checked: (algorithm, chunk_size or None).
    TypeError for a non-string algorithm or a non-int chunk_size, ValueError for an unknown
    algorithm, a chunk_size outside [1, MAX_CHUNK_SIZE] or one given with "recurrent"."""
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
    if algorithm == "recurrent":   # a size that would change nothing: the caller meant another form
        raise ValueError(f"chunk_size={c} is the chunkwise form's; algorithm='recurrent' has no "
                         f"chunks (pass chunk_size=None, or algorithm='chunk' or 'auto')")
    return algorithm, c


def refuse_chunk_with_checkpoints(algorithm, argument):
    """ValueError for algorithm="chunk" beside the recurrence's checkpoints (``argument``:
    ``return_checkpoints=True`` or ``checkpoints=``), which make the recurrence run."""
    if algorithm == "chunk":
        raise ValueError(f"{argument} hands over the recurrence's checkpoints, so the recurrence "
                         f"runs: algorithm='chunk' cannot be honoured with it (pass "
                         f"algorithm='auto' or 'recurrent', or leave out {argument})")


def chunk_for(algorithm, chunk_size, per_key=False):
    """What the compiled module is told for a call: (chunk, auto). chunk is the chunk size
    (DEFAULT_CHUNK_SIZE for None), 0 for "recurrent". auto: each (sequence, head) pair takes the
    chunkwise form only where it suits it -- a sequence of at least CHUNK_AUTO_MIN_LEN tokens
    and, with the delta rule, beta_t ||k_t||^2 <= CHUNK_AUTO_MAX_BETA_K2 at every token (the
    compiled module's constants; beyond it the UT transform's triangular solve amplifies
    rounding). A gate per key channel (per_key) has no chunkwise kernel: (0, False)."""
    algorithm, chunk_size = check_algorithm(algorithm, chunk_size)
    if algorithm == "recurrent" or per_key:
        return 0, False
    return (DEFAULT_CHUNK_SIZE if chunk_size is None else chunk_size), algorithm == "auto"
