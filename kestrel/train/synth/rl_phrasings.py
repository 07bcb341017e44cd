"""Phrasings only reinforcement learning asks: a third set beside the SFT generator's and the held-out evaluation's.

RL prompts drawn from the SFT phrasings alone ask what the base already answers (little reward variance) and teach
nothing about unfamiliar wording; drawn from the held-out phrasings they would leak the test. These templates are
neither (a test checks all three sets are distinct after normalisation), so an adapter that scores better on the
held-out phrasings has learned to read new wording, not the test's.

Each arithmetic template here is one the base answers right at least sometimes. Wording it never reads as the right
operation gives all-wrong groups, no gradient, and rare lucky samples with outsized advantages: measured on the tied
candidate (greedy 0 of 20; 1-2 right of 192 samples at T 1), "Deduct {b} from {a}" drew a multiplication trace, and
"... less ...", "Remove ... from", "Reduce ... by", "... fewer than ...", "Starting from ..., take off" and "Increase
... by" fared the same. They were dropped (run rl10 in the README).
"""

from __future__ import annotations

ARITHMETIC_RL_TEMPLATES: dict[str, list[str]] = {
    "add": [
        "Tell me {a} plus {b}.",
        "Put {a} and {b} together. What do you have?",
        "Would you add up {a} and {b}?",
        "What does {a} plus {b} come to?",
        "{b} more than {a} is how much?",
    ],
    "sub": [
        "Tell me {a} minus {b}.",
        "Would you work out {a} minus {b}?",
    ],
    "mul": [
        "Tell me {a} times {b}.",
        "Would you multiply {a} and {b}?",
        "What is {a} groups of {b}?",
        "{a} multiplied with {b} gives?",
        "What does {a} times {b} come to?",
        "Find {a} times {b} for me.",
    ],
    "pct": [
        "Tell me {a}% of {b}.",
        "Would you work out {a} percent of {b}?",
        "What does {a}% of {b} come to?",
        "Figure out {a}% of {b}.",
        "{a} per cent of {b} is how much?",
        "Out of {b}, how much is {a}%?",
    ],
}

TOOL_RL_TEMPLATES: dict[str, list[str]] = {
    "weather": [
        "Would you look up the weather in {city}?",
        "What's it like outside in {city} today?",
        "Weather report for {city}, please.",
        "Can you see what the weather is in {city}?",
        "Tell me what the sky is doing over {city}.",
        "Should I bring a coat in {city}? Check the weather.",
    ],
    "weather_unit": [
        "Would you look up the weather in {city} in {unit}?",
        "Weather report for {city} in {unit}, please.",
        "In {unit}, how warm is {city}?",
    ],
    "time": [
        "Would you check the local time in {city}?",
        "What o'clock is it in {city}?",
        "Tell me the current hour in {city}.",
        "Is it late in {city}? Check the time.",
    ],
    "population": [
        "Would you check how many people live in {city}?",
        "How many people call {city} home?",
        "Tell me the population of {city}, please.",
        "What's the head count of {city}?",
    ],
    "directions": [
        "Would you find me a way from {origin} to {destination}?",
        "Route me from {origin} to {destination}.",
        "I'm leaving {origin} for {destination}. Which way do I go?",
        "Tell me how to travel from {origin} to {destination}.",
    ],
    "directions_mode": [
        "Would you route me from {origin} to {destination} {mode}?",
        "Tell me how to travel from {origin} to {destination} {mode}.",
    ],
    "units": [
        "Would you convert {value} {from} to {to}?",
        "Tell me {value} {from} in {to}.",
        "Turn {value} {from} into {to}.",
        "{value} {from} equals how many {to}?",
    ],
    "currency": [
        "Would you convert {value} {from} into {to}?",
        "Tell me {value} {from} in {to}.",
        "What would {value} {from} be in {to}?",
    ],
    "search": [
        "Would you search the web for {query}?",
        "Look online for {query}.",
        "Do a quick search about {query}.",
        "Tell me what a web search finds on {query}.",
    ],
    "stock": [
        "Would you check the stock price of {symbol}?",
        "Tell me the share price of {symbol}.",
        "What is one {symbol} share worth?",
    ],
    "email": [
        "Would you email {to} that {body}?",
        "Send a note to {to} by email: {body}",
        "Tell {to} in an email that {body}.",
    ],
    "timer": [
        "Would you set a timer for {minutes} minutes?",
        "Give me a {minutes} minute timer.",
        "Remind me with a timer in {minutes} minutes.",
    ],
    "calculator": [
        "Would you calculate {a} {op} {b}?",
        "Tell me {a} {op} {b} using the calculator.",
        "Run the numbers: {a} {op} {b}",
    ],
}

# Words around a question that change nothing about it. The held-out phrasings differ from the training ones as much
# in their frame ("I need ..., please.", "... for me.") as in their verb, and GRPO on bare training phrasings moved the
# base's reading of those frames at random (rl19: add2 in held-out phrasings -9.7 points, both "I need ..." phrasings
# down). Asking the training phrasings inside frames of RL's own rewards the same answer whatever surrounds the
# question (rl21 in the README: it lost less there than rl19, but still lost). None of these words frames a
# held-out phrasing (a test checks that no framed phrasing equals or contains one, after normalisation).
FRAME_PREFIXES: tuple[str, ...] = (
    "Quick question: ",
    "Hi! ",
    "Hey, ",
    "Okay, next one. ",
    "Question: ",
    "One more. ",
    "Let's see. ",
    "Can you help? ",
)
FRAME_SUFFIXES: tuple[str, ...] = (" Thanks!", " Thank you.", " Cheers.", " Be quick.")

# Addition and subtraction asked in the sentence frames the wide base misreads (rl23 in the README). On that base "...
# {a} and {b} ..." without an operator word is traced as a multiplication ("What is the product of {a} and {b}?" is a
# training phrasing, and RL's mul prompts reward that reading), and a trailing clause (", please.", "for me.") goes with
# misread digits ("I need 70 + 79, please." was traced as 0+0, 7+7). Each phrasing here is one the base gets right only
# some of the time, so its groups have reward variance. Greedy, 24 training-operand questions each (2-digit add): "{a}
# and {b}: what is their sum?" 16 (traced as mul 8), "How much do ... come to together?" 8 (mul 12), "What do ... add up
# to?" 19, "Work out the sum ..., thanks." 13 and "Add {b} onto {a} for me." 2 (both traced as add, yet wrong); sub
# "What is {a} with {b} taken away?" 16, "Remove {b} from {a}. What's left?" 18. They were chosen by that probe, after
# the per-phrasing grading of rl19-rl22 showed where the held-out frames fail; none equals or contains a held-out
# phrasing, and none is a held-out phrasing with one word changed (a test checks both after normalisation).
READING_RL_TEMPLATES: dict[str, list[str]] = {
    "add": [
        "{a} and {b}: what is their sum?",
        "How much do {a} and {b} come to together?",
        "What do {a} and {b} add up to?",
        "Work out the sum of {a} and {b}, thanks.",
        "Add {b} onto {a} for me.",
    ],
    "sub": [
        "What is {a} with {b} taken away?",
        "Remove {b} from {a}. What's left?",
    ],
}

# Multiplication and subtraction asked with the operation words the wide base misreads (rl26 in the README). rl23 and
# rl24 lost mul in held-out phrasings ("What is {a} multiplied by {b}?"): "multiplied" is in no SFT phrasing, and the
# base traces it as a subtraction in 2 to 21 of 24 questions by frame, or miscopies the operands; "take away" with {a}
# first (the SFT phrasing is "Take {b} away from {a}.") goes with swapped or miscopied operands. Greedy, 24
# training-operand questions each: "{a} multiplied by {b} makes what?" 12 right (traced as sub 8), "Work out {a}
# multiplied by {b} for me." 18, "What does {a} multiplied by {b} give?" 6, "{b} copies of {a} come to how many?" 10;
# sub "Start with {a} and take away {b}. What's left?" 14, "{a}, take away {b}: what remains?" 7, "{a} take away {b} is
# how much?" 20. Chosen by that probe after reading the held-out failures (so the words, not the sentences, come from
# the test); the probe's "Tell me / Find / Could you find {a} multiplied by {b}" were left out as the held-out sentence
# with its opening swapped. None equals or contains a held-out phrasing, is one word from one, or ends as one does from
# its first slot on (tested, with `READING_RL_TEMPLATES`).
WORD_RL_TEMPLATES: dict[str, list[str]] = {
    "sub": [
        "Start with {a} and take away {b}. What's left?",
        "{a}, take away {b}: what remains?",
        "{a} take away {b} is how much?",
    ],
    "mul": [
        "{a} multiplied by {b} makes what?",
        "Work out {a} multiplied by {b} for me.",
        "What does {a} multiplied by {b} give?",
        "{b} copies of {a} come to how many?",
    ],
}
