"""Numerics probes (docs/numerics.md). Import the module you need; nothing is loaded here.

stall    where a running sum in each format stops moving, and why
bias     bias vs variance of a low-precision callable or all-reduce against fp64
sites    the stall in a collective, in .grad accumulation and in weight updates
reveal   summation order, accumulator bits and rounding of a black-box reduction
impact   a data-parallel training run through the emulated all-reduce per format
"""
