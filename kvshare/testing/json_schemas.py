"""Ten JSON schemas the structured-output tests and benchmarks share: nested objects, arrays,
enums, required fields and bounded numbers, each with a prompt that invites an answer."""
from __future__ import annotations

SCHEMAS: list[tuple[str, dict]] = [
    ("person", {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 40},
                       "age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["name", "age"], "additionalProperties": False,
    }),
    ("colour_enum", {
        "type": "object",
        "properties": {"colour": {"type": "string", "enum": ["red", "green", "blue"]}},
        "required": ["colour"], "additionalProperties": False,
    }),
    ("city_nested", {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 30},
            "location": {"type": "object",
                         "properties": {"lat": {"type": "number", "minimum": -90, "maximum": 90},
                                        "lon": {"type": "number", "minimum": -180, "maximum": 180}},
                         "required": ["lat", "lon"], "additionalProperties": False},
        },
        "required": ["city", "location"], "additionalProperties": False,
    }),
    ("shopping_list", {
        "type": "object",
        "properties": {"items": {"type": "array", "minItems": 1, "maxItems": 4,
                                 "items": {"type": "string", "maxLength": 20}}},
        "required": ["items"], "additionalProperties": False,
    }),
    ("rating", {
        "type": "object",
        "properties": {"score": {"type": "number", "minimum": 1, "maximum": 5},
                       "comment": {"type": "string", "maxLength": 60}},
        "required": ["score"], "additionalProperties": False,
    }),
    ("boolean_flags", {
        "type": "object",
        "properties": {"is_open": {"type": "boolean"}, "has_parking": {"type": "boolean"}},
        "required": ["is_open", "has_parking"], "additionalProperties": False,
    }),
    ("order", {
        "type": "object",
        "properties": {
            "order_id": {"type": "integer", "minimum": 1, "maximum": 99999},
            "lines": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
                "type": "object",
                "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
                               "qty": {"type": "integer", "minimum": 1, "maximum": 9}},
                "required": ["sku", "qty"], "additionalProperties": False}},
        },
        "required": ["order_id", "lines"], "additionalProperties": False,
    }),
    ("weather", {
        "type": "object",
        "properties": {"condition": {"enum": ["sunny", "cloudy", "rain", "snow"]},
                       "temperature_c": {"type": "integer", "minimum": -50, "maximum": 50}},
        "required": ["condition", "temperature_c"], "additionalProperties": False,
    }),
    ("matrix", {
        "type": "object",
        "properties": {"rows": {"type": "array", "minItems": 2, "maxItems": 2, "items": {
            "type": "array", "minItems": 2, "maxItems": 2,
            "items": {"type": "integer", "minimum": 0, "maximum": 9}}}},
        "required": ["rows"], "additionalProperties": False,
    }),
    ("book", {
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 40},
            "author": {"type": "object", "properties": {"first": {"type": "string", "maxLength": 20},
                                                        "last": {"type": "string", "maxLength": 20}},
                       "required": ["last"], "additionalProperties": False},
            "year": {"type": "integer", "minimum": 1400, "maximum": 2030},
            "genre": {"type": "string", "enum": ["novel", "poetry", "science", "history"]},
        },
        "required": ["title", "author", "year", "genre"], "additionalProperties": False,
    }),
]

PROMPTS: dict[str, str] = {
    "person": "Describe a fictional person as JSON with their name and age.",
    "colour_enum": "Pick a colour and answer as JSON.",
    "city_nested": "Give a city and its coordinates as JSON.",
    "shopping_list": "Write a short shopping list as JSON.",
    "rating": "Rate a restaurant from 1 to 5 as JSON, with a comment.",
    "boolean_flags": "Is the shop open, and does it have parking? Answer as JSON.",
    "order": "Write an order with one or two lines as JSON.",
    "weather": "Report today's weather as JSON.",
    "matrix": "Give a 2x2 matrix of digits as JSON.",
    "book": "Describe a famous book as JSON.",
}
