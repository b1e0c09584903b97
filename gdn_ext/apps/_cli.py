"""Argument types shared by the command-line applications (argparse ``type=`` callables that
turn a bad value into a usage error, not a traceback)."""
import argparse
import math


def positive_int(text):
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return n


def non_negative_int(text):
    n = int(text)
    if n < 0:
        raise argparse.ArgumentTypeError(f"must be a non-negative integer, got {text}")
    return n


def positive_float(text):
    x = float(text)
    if not (x > 0 and math.isfinite(x)):
        raise argparse.ArgumentTypeError(f"must be a positive finite number, got {text}")
    return x
