"""Redistributable text for training the fixture tokenizer and model.

Two sources, both free to redistribute:

* **Project-written synthetic dialogues** (Apache-2.0, this repository):
  chat turns rendered in Spark's real chat frame (docs/MODEL.md §13), tool
  calls in Spark's tool-call format (§14), JSON tool results, code snippets
  and short sentences in English, French, German, Spanish and Chinese.
  Generated procedurally from a fixed seed, so the corpus is reproducible.
* **CPython 3.11 standard library** (PSF License 2.0, permissive and
  redistributable): English prose from `pydoc_data/topics.py` (the language
  reference shipped inside Python) and Python source from a fixed list of
  stdlib modules.

The split is by document: every 10th document is held out (`held_out`) and
never used for training; TRAINING.md reports perplexity on it.
"""

from __future__ import annotations

import json
import random
import sysconfig
from pathlib import Path

BOS = "<｜start▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
SYSTEM_LINE = "you are a helpful assistant."

STDLIB_MODULES = [
    "argparse.py", "base64.py", "bisect.py", "calendar.py", "colorsys.py",
    "configparser.py", "contextlib.py", "copy.py", "csv.py", "dataclasses.py",
    "datetime.py", "difflib.py", "enum.py", "fnmatch.py", "fractions.py",
    "functools.py", "glob.py", "gzip.py", "heapq.py", "hmac.py", "ipaddress.py",
    "json/decoder.py", "json/encoder.py", "json/__init__.py", "keyword.py",
    "linecache.py", "locale.py", "numbers.py", "operator.py", "pathlib.py",
    "pprint.py", "queue.py", "random.py", "reprlib.py", "sched.py", "secrets.py",
    "shlex.py", "shutil.py", "statistics.py", "string.py", "textwrap.py",
    "timeit.py", "tokenize.py", "uuid.py", "weakref.py", "zipfile.py",
]

# ---------------------------------------------------------------- synthetic
CITIES = ["Paris", "Berlin", "Madrid", "Tokyo", "Lagos", "Lima", "Oslo", "Cairo",
          "Seoul", "Toronto", "Nairobi", "Lisbon", "Hanoi", "Quito", "Dublin"]
UNITS = ["celsius", "fahrenheit"]
NAMES = ["Ada", "Linus", "Grace", "Alan", "Marie", "Yuki", "Omar", "Priya",
         "Chen", "Sofia", "Kwame", "Elena"]
ITEMS = ["apples", "books", "tickets", "batteries", "chairs", "lamps", "cables"]

TOOLS = [
    {"name": "get_weather", "description": "Get the current weather for a city.",
     "parameters": {"type": "object", "properties": {
         "city": {"type": "string"}, "unit": {"type": "string", "enum": UNITS}},
         "required": ["city"]}},
    {"name": "search_web", "description": "Search the web and return the top results.",
     "parameters": {"type": "object", "properties": {
         "query": {"type": "string"}, "max_results": {"type": "integer"}},
         "required": ["query"]}},
    {"name": "calculator", "description": "Evaluate an arithmetic expression.",
     "parameters": {"type": "object", "properties": {
         "expression": {"type": "string"}}, "required": ["expression"]}},
    {"name": "send_email", "description": "Send an email to a contact.",
     "parameters": {"type": "object", "properties": {
         "to": {"type": "string"}, "subject": {"type": "string"},
         "body": {"type": "string"}}, "required": ["to", "subject"]}},
    {"name": "set_timer", "description": "Start a countdown timer.",
     "parameters": {"type": "object", "properties": {
         "minutes": {"type": "integer"}}, "required": ["minutes"]}},
]

SENTENCES = {
    "en": ["The weather in {c} is {t} degrees today.", "{n} bought {k} {i} at the market.",
           "Please remind me to call {n} tomorrow morning.", "How many {i} are left in the store?",
           "The train from {c} arrives at {h} o'clock.", "{n} is learning to write Rust code."],
    "fr": ["Il fait {t} degrés à {c} aujourd'hui.", "{n} a acheté {k} {i} au marché.",
           "Le train de {c} arrive à {h} heures.", "Merci de rappeler {n} demain matin."],
    "de": ["In {c} sind es heute {t} Grad.", "{n} hat {k} {i} auf dem Markt gekauft.",
           "Der Zug aus {c} kommt um {h} Uhr an.", "Bitte erinnere mich morgen an {n}."],
    "es": ["Hoy hace {t} grados en {c}.", "{n} compró {k} {i} en el mercado.",
           "El tren de {c} llega a las {h}.", "Por favor, recuérdame llamar a {n} mañana."],
    "zh": ["今天{c}的气温是{t}度。", "{n}在市场买了{k}个东西。", "火车{h}点从{c}出发。",
           "请明天提醒我给{n}打电话。"],
}

CODE_SNIPPETS = [
    "def add(a, b):\n    return a + b\n",
    "fn main() {\n    let v: Vec<u32> = (0..{k}).collect();\n    println!(\"{:?}\", v);\n}\n",
    "for i in range({k}):\n    print(i * i)\n",
    "const total = items.reduce((acc, x) => acc + x.price, 0);\n",
    "SELECT name, count(*) FROM orders WHERE city = '{c}' GROUP BY name;\n",
]


def _fill(rng: random.Random, template: str) -> str:
    return (template.replace("{c}", rng.choice(CITIES)).replace("{n}", rng.choice(NAMES))
            .replace("{i}", rng.choice(ITEMS)).replace("{k}", str(rng.randint(2, 40)))
            .replace("{t}", str(rng.randint(-5, 35))).replace("{h}", str(rng.randint(1, 12))))


def render_tool_call(name: str, args: dict) -> str:
    parts = [f"<tool_call>{name}"]
    for k, v in args.items():
        val = v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)
        parts.append(f"<arg_key>{k}</arg_key><arg_value>{val}</arg_value>")
    parts.append("</tool_call>")
    return "".join(parts)


def render_system(tools: list | None, system: str | None) -> str:
    text = f"{BOS}<|System|>\n{SYSTEM_LINE}"
    if tools:
        text += "## Tools\nYou have access to the following functions:\n<tools>"
        for t in tools:
            text += "\n" + json.dumps(t, ensure_ascii=False)
        text += "\n</tools>"
    if system:
        text += "\n\n" + system
    return text + EOS


def _tool_dialogue(rng: random.Random) -> str:
    tools = rng.sample(TOOLS, k=rng.randint(1, 3))
    tool = rng.choice(tools)
    name = tool["name"]
    if name == "get_weather":
        city = rng.choice(CITIES)
        unit = rng.choice(UNITS)
        ask = rng.choice([f"What's the weather in {city}?", f"Is it cold in {city} right now?",
                          f"Quel temps fait-il à {city} ?", f"Wie ist das Wetter in {city}?"])
        args = {"city": city, "unit": unit}
        temp = rng.randint(-5, 35)
        result = {"city": city, "temperature": temp, "unit": unit,
                  "condition": rng.choice(["sunny", "cloudy", "rain", "snow"])}
        answer = f"It is {temp} degrees {unit} in {city} and {result['condition']}."
    elif name == "search_web":
        topic = rng.choice(["rust borrow checker", "gptq quantization", "sliding window attention",
                            "best pizza in " + rng.choice(CITIES), "how to bake bread"])
        ask = f"Search the web for {topic}."
        args = {"query": topic, "max_results": rng.randint(1, 5)}
        result = {"results": [{"title": f"{topic.title()} explained", "url": f"https://example.org/{i}"}
                              for i in range(args["max_results"])]}
        answer = f"I found {args['max_results']} results about {topic}."
    elif name == "calculator":
        a, b = rng.randint(2, 999), rng.randint(2, 999)
        op = rng.choice(["+", "-", "*"])
        expr = f"{a} {op} {b}"
        ask = rng.choice([f"What is {expr}?", f"Compute {expr} please.", f"Calcule {expr}."])
        args = {"expression": expr}
        value = eval(expr)  # noqa: S307 - integers we just generated
        result = {"value": value}
        answer = f"{expr} = {value}."
    elif name == "send_email":
        who = rng.choice(NAMES)
        subj = rng.choice(["Meeting", "Invoice", "Lunch", "Report"])
        ask = f"Email {who} about the {subj.lower()}."
        args = {"to": f"{who.lower()}@example.com", "subject": subj,
                "body": f"Hi {who}, a quick note about the {subj.lower()}."}
        result = {"status": "sent", "id": rng.randint(1000, 9999)}
        answer = f"Done, the email to {who} was sent."
    else:
        minutes = rng.randint(1, 90)
        ask = f"Set a timer for {minutes} minutes."
        args = {"minutes": minutes}
        result = {"status": "started", "minutes": minutes}
        answer = f"Your {minutes}-minute timer is running."
    think = rng.random() < 0.5
    text = render_system(tools, None)
    text += f"{BOS}<|User|>{ask}{EOS}"
    text += f"{BOS}<|Bot|>" + ("<think>I should call " + name + ".</think>" if think else "</think>")
    text += render_tool_call(name, args) + EOS
    text += f"{BOS}<|Tool|><tool_response>{json.dumps(result, ensure_ascii=False)}</tool_response>{EOS}"
    text += f"{BOS}<|Bot|></think>{answer}{EOS}"
    return text


def _chat_dialogue(rng: random.Random) -> str:
    lang = rng.choice(list(SENTENCES))
    turns = rng.randint(1, 3)
    system = rng.choice([None, None, "Answer briefly.", "Réponds en français."])
    text = render_system(None, system)
    for _ in range(turns):
        user = _fill(rng, rng.choice(SENTENCES[lang]))
        if rng.random() < 0.3:
            user += " Show me code.\n" + _fill(rng, rng.choice(CODE_SNIPPETS))
        reply = " ".join(_fill(rng, rng.choice(SENTENCES[lang])) for _ in range(rng.randint(1, 3)))
        text += f"{BOS}<|User|>{user}{EOS}{BOS}<|Bot|></think>{reply}{EOS}"
    return text


def synthetic_documents(n: int, seed: int = 1234) -> list[str]:
    rng = random.Random(seed)
    return [(_tool_dialogue if rng.random() < 0.5 else _chat_dialogue)(rng) for _ in range(n)]


def stdlib_documents() -> list[str]:
    lib = Path(sysconfig.get_paths()["stdlib"])
    docs = []
    topics = lib / "pydoc_data" / "topics.py"
    if topics.exists():
        ns: dict = {}
        exec(compile(topics.read_text(encoding="utf-8"), str(topics), "exec"), ns)  # noqa: S102
        for key in sorted(ns["topics"]):
            docs.append(ns["topics"][key])
    for rel in STDLIB_MODULES:
        p = lib / rel
        if p.exists():
            src = p.read_text(encoding="utf-8")
            # Cut long modules into ~4 KB documents so the held-out split mixes.
            for i in range(0, len(src), 4000):
                docs.append(src[i:i + 4000])
    return docs


def corpus(n_synthetic: int = 6000) -> tuple[list[str], list[str]]:
    """(train, held_out) documents; every 10th document is held out."""
    docs = synthetic_documents(n_synthetic) + stdlib_documents()
    rng = random.Random(99)
    rng.shuffle(docs)
    train = [d for i, d in enumerate(docs) if i % 10 != 0]
    held = [d for i, d in enumerate(docs) if i % 10 == 0]
    return train, held


if __name__ == "__main__":
    tr, ho = corpus()
    print(f"train docs {len(tr)} chars {sum(map(len, tr))}; held-out docs {len(ho)} chars {sum(map(len, ho))}")
    print(tr[0][:600])
