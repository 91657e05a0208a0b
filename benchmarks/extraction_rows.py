"""Writes a structured-extraction job: N rows, each a short text and its own JSON schema
(OpenAI's ``response_format``), drawn from ten kinds of record with seeded random values:

    .venv/bin/python benchmarks/extraction_rows.py --n 200 --out data/extraction_job_200.jsonl
    specdec-llm run data/extraction_job_200.jsonl --pair qwen2.5-coder-1.5b --chat --max-new-tokens 256

The texts are generated, not collected: they test that every row's output parses and
satisfies its schema (constrained decoding), not what a model knows. Schemas mix strings,
integers, numbers, booleans, enums, arrays and nested objects; the prompt names the fields,
as a user's would.
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Callable
from pathlib import Path

FIRST = ["Maria", "Tomas", "Aiko", "Kwame", "Lena", "Ravi", "Sofia", "Jonas", "Amara", "Diego", "Mei", "Olu"]
LAST = ["Kowalski", "Ferreira", "Tanaka", "Mensah", "Berg", "Iyer", "Rossi", "Weber", "Okafor", "Silva", "Chen"]
CITIES = ["Gdansk", "Lisbon", "Osaka", "Accra", "Bergen", "Pune", "Turin", "Leipzig", "Lagos", "Quito", "Hobart"]
JOBS = ["structural engineer", "head chef", "nurse", "data analyst", "carpenter", "pilot", "teacher", "architect"]
ITEMS = [("USB-C cable", 9.5), ("laptop stand", 42.0), ("desk lamp", 27.9), ("notebook", 3.2), ("mouse", 18.0)]
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October"]


def obj(props: dict, required: list[str] | None = None) -> dict:
    return {
        "type": "object",
        "properties": props,
        "required": required if required is not None else list(props),
        "additionalProperties": False,
    }


STR, INT, NUM, BOOL = {"type": "string"}, {"type": "integer"}, {"type": "number"}, {"type": "boolean"}


def person(r: random.Random) -> tuple[str, dict]:
    name, age, city, job = f"{r.choice(FIRST)} {r.choice(LAST)}", r.randint(19, 77), r.choice(CITIES), r.choice(JOBS)
    text = r.choice(
        [
            f"{name}, {age}, works as a {job} in {city}.",
            f"Meet {name}: a {job} based in {city}, {age} years old.",
            f"In {city}, the {job} {name} (aged {age}) spoke to us.",
        ]
    )
    return f"Extract the person (name, age, city, occupation).\n\n{text}", obj(
        {"name": STR, "age": INT, "city": STR, "occupation": STR}
    )


def invoice(r: random.Random) -> tuple[str, dict]:
    lines = r.sample(ITEMS, r.randint(1, 3))
    qty = [r.randint(1, 4) for _ in lines]
    body = ", ".join(f"{q} x {n} at {p:.2f} EUR" for q, (n, p) in zip(qty, lines))
    total = sum(q * p for q, (_, p) in zip(qty, lines))
    number = f"INV-{r.randint(1000, 9999)}"
    item = obj({"description": STR, "quantity": INT, "unit_price": NUM})
    schema = obj({"invoice_number": STR, "items": {"type": "array", "items": item}, "total": NUM, "currency": STR})
    return (
        f"Turn this invoice into JSON (invoice_number, items, total, currency).\n\nInvoice {number}. {body}. Total: {total:.2f} EUR.",
        schema,
    )


def event(r: random.Random) -> tuple[str, dict]:
    day, month, city = r.randint(1, 28), r.choice(MONTHS), r.choice(CITIES)
    kind = r.choice(["concert", "conference", "marathon", "book fair", "workshop"])
    free = r.random() < 0.5
    text = f"The {city} {kind} takes place on {month} {day}; entry is {'free' if free else 'ticketed'}."
    schema = obj({"name": STR, "city": STR, "month": {"enum": MONTHS}, "day": INT, "free_entry": BOOL})
    return f"Extract the event (name, city, month, day, free_entry).\n\n{text}", schema


def product(r: random.Random) -> tuple[str, dict]:
    name, price = r.choice(ITEMS)
    stock = r.randint(0, 40)
    colours = r.sample(["black", "white", "red", "blue", "green"], r.randint(1, 3))
    text = f"The {name} costs {price:.2f} EUR, comes in {', '.join(colours)}, and {stock} are in stock."
    schema = obj({"product": STR, "price_eur": NUM, "colours": {"type": "array", "items": STR}, "in_stock": INT})
    return f"Describe the product as JSON (product, price_eur, colours, in_stock).\n\n{text}", schema


def address(r: random.Random) -> tuple[str, dict]:
    street = f"{r.randint(1, 240)} {r.choice(['Harbour', 'Mill', 'Station', 'Garden', 'Market'])} Street"
    city, code = r.choice(CITIES), f"{r.randint(10000, 99999)}"
    text = f"Please send it to {r.choice(FIRST)} {r.choice(LAST)}, {street}, {code} {city}."
    addr = obj({"street": STR, "postal_code": STR, "city": STR})
    return f"Extract the recipient and address (recipient, address).\n\n{text}", obj(
        {"recipient": STR, "address": addr}
    )


def flight(r: random.Random) -> tuple[str, dict]:
    a, b = r.sample(CITIES, 2)
    number, hour, minute = (
        f"{r.choice(['LX', 'TP', 'NH', 'KL'])}{r.randint(100, 999)}",
        r.randint(0, 23),
        r.choice([0, 15, 30, 45]),
    )
    delayed = r.random() < 0.4
    text = f"Flight {number} from {a} to {b} leaves at {hour:02d}:{minute:02d}{' and is delayed' if delayed else ', on time'}."
    schema = obj(
        {
            "flight": STR,
            "origin": STR,
            "destination": STR,
            "departure": {"type": "string", "pattern": "^[0-2][0-9]:[0-5][0-9]$"},
            "delayed": BOOL,
        }
    )
    return f"Extract the flight (flight, origin, destination, departure as HH:MM, delayed).\n\n{text}", schema


def review(r: random.Random) -> tuple[str, dict]:
    stars = r.randint(1, 5)
    mood = {1: "awful", 2: "disappointing", 3: "fine", 4: "very good", 5: "excellent"}[stars]
    what = r.choice(["the hotel", "the ramen place", "this kettle", "the city tour"])
    text = f"{stars}/5. {what.capitalize()} was {mood}; {r.choice(['staff were kind', 'it was noisy', 'great value'])}."
    schema = obj(
        {
            "subject": STR,
            "stars": {"type": "integer", "minimum": 1, "maximum": 5},
            "sentiment": {"enum": ["negative", "neutral", "positive"]},
        }
    )
    return f"Classify the review (subject, stars, sentiment).\n\n{text}", schema


def recipe(r: random.Random) -> tuple[str, dict]:
    dish = r.choice(["pancakes", "lentil soup", "flatbread", "omelette"])
    parts = r.sample(["flour", "milk", "eggs", "salt", "lentils", "onion", "butter", "water"], r.randint(2, 4))
    minutes = r.choice([10, 15, 20, 30, 45])
    text = f"For {dish}, mix {', '.join(parts)} and cook for {minutes} minutes. Serves {r.randint(1, 6)}."
    schema = obj({"dish": STR, "ingredients": {"type": "array", "items": STR}, "minutes": INT, "servings": INT})
    return f"Extract the recipe (dish, ingredients, minutes, servings).\n\n{text}", schema


def meeting(r: random.Random) -> tuple[str, dict]:
    people = [r.choice(FIRST) for _ in range(r.randint(2, 3))]
    text = f"{' and '.join(people)} meet on {r.choice(MONTHS)} {r.randint(1, 28)} in room {r.randint(1, 9)}{r.choice('ABC')} to review the budget."
    schema = obj({"attendees": {"type": "array", "items": STR}, "date": STR, "room": STR, "topic": STR})
    return f"Extract the meeting (attendees, date, room, topic).\n\n{text}", schema


def contact(r: random.Random) -> tuple[str, dict]:
    first, last = r.choice(FIRST), r.choice(LAST)
    phone = f"+{r.randint(30, 49)} {r.randint(100, 999)} {r.randint(1000, 9999)}"
    vip = r.random() < 0.3
    text = f"You can reach {first} {last} at {first.lower()}.{last.lower()}@example.org or {phone}.{' Priority customer.' if vip else ''}"
    schema = obj({"name": STR, "email": STR, "phone": STR, "priority": BOOL}, ["name", "email", "phone", "priority"])
    return f"Extract the contact (name, email, phone, priority).\n\n{text}", schema


KINDS: dict[str, Callable[[random.Random], tuple[str, dict]]] = {
    f.__name__: f for f in (person, invoice, event, product, address, flight, review, recipe, meeting, contact)
}


def rows(n: int, seed: int = 0) -> list[dict]:
    r = random.Random(seed)
    names = list(KINDS)
    out = []
    for i in range(n):
        kind = names[i % len(names)]
        prompt, schema = KINDS[kind](r)
        fmt = {"type": "json_schema", "json_schema": {"name": kind, "schema": schema, "strict": True}}
        out.append({"id": f"{kind}-{i}", "prompt": prompt, "response_format": fmt})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("data/extraction_job_200.jsonl"))
    args = ap.parse_args()
    args.out.write_text("".join(json.dumps(row) + "\n" for row in rows(args.n, args.seed)), encoding="utf-8")
    print(f"{args.n} rows -> {args.out}")


if __name__ == "__main__":
    main()
