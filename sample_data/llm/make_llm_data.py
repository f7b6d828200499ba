"""Write the small instruction set the LLM path trains on by default: alpaca.jsonl and chat.jsonl.

Run from anywhere: `python sample_data/llm/make_llm_data.py`. The examples are made from templates
(colours of things, reversing words, counting, shapes), deterministic, so a tiny model can learn them
in a minute on a CPU and the preview answers show the difference.
"""
from __future__ import annotations

import json
from pathlib import Path

HERE = Path(__file__).resolve().parent

COLOURS = {"a ripe banana": "yellow", "the sky on a clear day": "blue", "fresh grass": "green",
           "a ripe tomato": "red", "snow": "white", "coal": "black", "an orange": "orange",
           "a lavender flower": "purple"}
WORDS = ["garden", "planet", "silver", "window", "rocket", "candle", "forest", "button", "yellow", "mirror"]
NUMBERS = ["one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"]
SHAPES = {"triangle": 3, "square": 4, "pentagon": 5, "hexagon": 6, "octagon": 8}


def alpaca() -> list[dict]:
    out = []
    for thing, colour in COLOURS.items():
        out.append({"instruction": f"What colour is {thing}?", "input": "",
                    "output": f"{thing[0].upper()}{thing[1:]} is {colour}."})
    for w in WORDS:
        out.append({"instruction": f"Reverse the word: {w}", "input": "", "output": w[::-1]})
    for n in range(3, 8):
        out.append({"instruction": f"Count from one to {NUMBERS[n - 1]}.", "input": "",
                    "output": ", ".join(NUMBERS[:n]).capitalize() + "."})
    for shape, sides in SHAPES.items():
        out.append({"instruction": "How many sides does this shape have?", "input": shape,
                    "output": f"A {shape} has {sides} sides."})
    for w in WORDS[:6]:
        out.append({"instruction": "Write the word in capital letters.", "input": w, "output": w.upper()})
    return out


def chat() -> list[dict]:
    out = []
    for w in WORDS[:5]:
        out.append({"messages": [
            {"role": "user", "content": f"Spell {w} backwards."},
            {"role": "assistant", "content": w[::-1]},
            {"role": "user", "content": "And how many letters does it have?"},
            {"role": "assistant", "content": f"It has {len(w)} letters."},
        ]})
    for thing, colour in list(COLOURS.items())[:5]:
        out.append({"messages": [
            {"role": "system", "content": "You answer in one short sentence."},
            {"role": "user", "content": f"Tell me the colour of {thing}."},
            {"role": "assistant", "content": f"It is {colour}."},
        ]})
    for shape, sides in SHAPES.items():
        out.append({"messages": [
            {"role": "user", "content": f"Draw me a {shape} in words."},
            {"role": "assistant", "content": f"Picture a closed shape with {sides} straight sides: a {shape}."},
        ]})
    return out


def write(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")


if __name__ == "__main__":
    write(HERE / "alpaca.jsonl", alpaca())
    write(HERE / "chat.jsonl", chat())
    print(f"wrote {HERE / 'alpaca.jsonl'} and {HERE / 'chat.jsonl'}")
