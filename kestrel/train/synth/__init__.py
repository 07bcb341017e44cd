"""Synthetic chat episodes for SFT and held-out evaluation: arithmetic with worked traces, tool calls, small talk.

Every slot value (a place, a search topic, a pair of operands) and every phrasing template belongs to exactly one
split, `train` or `held_out`; the evaluation draws only held-out ones, so it measures copying and procedures,
not memory.
"""
