"""50 JSON schemas of varied shape for the structured-output tests: nested objects, arrays with
bounds, enums, required and optional fields, integers and numbers with ranges, booleans, nulls.
Deterministic (a seeded generator); strings and arrays are bounded so a small model's output
completes within a modest max_tokens."""
import random

WORDS = ["red", "green", "blue", "cat", "dog", "list", "dict", "set", "tuple", "loop"]


def _leaf(rng: random.Random) -> dict:
    kind = rng.choice(["string", "integer", "number", "boolean", "enum", "null_or_int", "const"])
    if kind == "string":
        return {"type": "string", "minLength": rng.randint(0, 2), "maxLength": rng.randint(3, 8)}
    if kind == "integer":
        lo = rng.randint(-50, 50)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 100)}
    if kind == "number":
        lo = rng.randint(-10, 10)
        return {"type": "number", "minimum": lo, "maximum": lo + rng.randint(1, 20)}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        return {"enum": rng.sample(WORDS, rng.randint(1, 4))}
    if kind == "const":
        return {"const": rng.choice(WORDS)}
    return {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"type": "null"}]}


def _value(rng: random.Random, depth: int) -> dict:
    r = rng.random()
    if depth < 2 and r < 0.2:
        return _object(rng, depth + 1)
    if depth < 2 and r < 0.4:
        lo = rng.randint(0, 1)
        return {"type": "array", "items": _value(rng, depth + 1), "minItems": lo, "maxItems": lo + rng.randint(0, 2)}
    return _leaf(rng)


def _object(rng: random.Random, depth: int) -> dict:
    names = rng.sample(["id", "name", "kind", "size", "ok", "items", "meta", "tags", "score", "note"],
                       rng.randint(1, 4 if depth == 0 else 2))
    props = {n: _value(rng, depth) for n in names}
    required = [n for n in names if rng.random() < 0.7]
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


def schemas(count: int = 50, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [_object(rng, 0) for _ in range(count)]
