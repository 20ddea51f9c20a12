"""Training prompts built offline: Python's standard library and instructions written here.

Never the benchmark sets (MT-bench, HumanEval): the prompts come from stdlib docstrings and
signatures, man-page summaries, and templates over hand-written topics. Each prompt is either a chat
message (rendered with the target's chat template) or raw text the target continues (code completion).
"""

from __future__ import annotations

import gzip
import importlib
import inspect
import random
import re
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class TrainingPrompt:
    source: str  # the data-mix bucket: code-completion, code-chat, explain-api, man, writing, ...
    text: str
    chat: bool  # chat message (True) or raw text to continue (False)


SKIP_MODULES = {"antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo", "test", "lib2to3",
                "ensurepip", "venv", "pydoc_data", "__main__", "__phello__", "_pyrepl", "xxlimited"}


def stdlib_functions(limit_modules: int | None = None) -> list[tuple[str, str, str, str]]:
    """``(module, name, signature, docstring)`` for documented pure-Python stdlib functions."""
    found = []
    names = sorted(getattr(sys, "stdlib_module_names", ()))
    for module_name in names[:limit_modules]:
        if module_name.startswith("_") or module_name in SKIP_MODULES:
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                module = importlib.import_module(module_name)
            except BaseException:  # some modules refuse to import on this platform
                continue
        members = []
        for name, obj in sorted(vars(module).items()):
            if name.startswith("_") or getattr(obj, "__module__", None) != module_name:
                continue
            if inspect.isfunction(obj):
                members.append((name, obj))
            elif inspect.isclass(obj):  # methods widen the pool of documented code
                members.extend((meth, fn) for meth, fn in sorted(vars(obj).items())
                               if inspect.isfunction(fn) and not meth.startswith("_"))
        for name, obj in members:
            doc = inspect.getdoc(obj) or ""
            if not 40 <= len(doc) <= 900:
                continue
            try:
                signature = str(inspect.signature(obj))
            except (TypeError, ValueError):
                continue
            if len(signature) > 120:
                continue
            found.append((module_name, name, signature, doc))
    return found


def _indent_doc(doc: str) -> str:
    lines = doc.replace('"""', "'''").splitlines()
    return "\n".join(("    " + line) if line.strip() else "" for line in lines)


def code_completion_prompt(module: str, name: str, signature: str, doc: str, rng: random.Random) -> str:
    """A function header plus docstring, left for the model to implement (raw text, no template)."""
    header = rng.choice(["", "", f"import {module}\n\n\n", "from typing import List, Optional\n\n\n",
                         "import math\nfrom typing import List\n\n\n"])
    return f'{header}def {name}{signature}:\n    """{_indent_doc(doc).lstrip()}\n    """\n'


def man_summaries(limit: int = 4000) -> list[tuple[str, str]]:
    """``(command, one-line summary)`` from the NAME sections of installed section-1 man pages."""
    root = Path("/usr/share/man/man1")
    out = []
    if not root.is_dir():
        return out
    for path in sorted(root.glob("*.1*"))[: limit * 3]:
        try:
            opener = gzip.open if path.suffix == ".gz" else open
            with opener(path, "rt", encoding="utf-8", errors="replace") as f:
                text = f.read(4000)
        except OSError:
            continue
        match = re.search(r"\.SH\s+\"?NAME\"?\s*\n(.+?)\n\.", text, re.S)
        if not match:
            continue
        line = re.sub(r"\\f[BIRP]|\\-|\\\(em|\\&|\\ ", lambda m: "-" if m.group(0) == "\\-" else " ", match.group(1))
        line = " ".join(line.split())
        if " - " not in line:
            continue
        command, summary = line.split(" - ", 1)
        command = command.split(",")[0].strip()
        if re.fullmatch(r"[A-Za-z0-9][\w.+-]{1,29}", command) and 10 <= len(summary) <= 160:
            out.append((command, summary.rstrip(".")))
        if len(out) >= limit:
            break
    return out


TOPICS = """photosynthesis; the water cycle; black holes; the French Revolution; the Roman Empire; climate change;
vaccines; the stock market; inflation; machine learning; the internet; electric cars; renewable energy; volcanoes;
earthquakes; the human heart; sleep; meditation; coffee; chess; jazz music; the Renaissance; ancient Egypt;
the Silk Road; plate tectonics; quantum computing; blockchain; the printing press; the Industrial Revolution;
honeybees; coral reefs; the Amazon rainforest; the Moon landing; Mars exploration; DNA; evolution; antibiotics;
the immune system; supply and demand; compound interest; remote work; social media; public libraries;
urban gardening; recycling; the Olympic Games; the Great Wall of China; the Cold War; democracy; volunteering;
time management; learning a new language; marathon training; healthy breakfasts; budget travel; minimalism;
friendship; job interviews; public speaking; procrastination; the history of tea; bread baking; photography;
video games; smartphones; 3D printing; self-driving cars; nuclear energy; the ozone layer; tides; rainbows;
glaciers; deserts; the Pacific Ocean; migration of birds; dinosaurs; the periodic table; gravity; magnetism;
the speed of light; relativity; statistics; probability; prime numbers; geometry; algebra; the Fibonacci sequence;
cryptography; open-source software; databases; operating systems; computer networks; cloud computing;
cybersecurity; password safety; electric guitars; classical music; Shakespeare; poetry; the novel; museums;
architecture; the Eiffel Tower; city planning; public transport; bicycles; trains; airplanes; ships; rivers;
mountains; forests; the Arctic; penguins; elephants; cats; dogs; gardening; composting; chocolate; spices;
the history of money; taxes; insurance; small businesses; marketing; customer service; teamwork; leadership;
negotiation; ethics in AI; privacy; the scientific method; critical thinking; philosophy; Stoicism; Socrates;
the Industrial design of chairs; fashion; textiles; the Olympics; football; basketball; tennis; swimming""".replace("\n", " ")

WRITING = ["Write a short blog post about {t}.", "Write a persuasive paragraph arguing for more attention to {t}.",
           "Compose a short poem about {t}.", "Write a product description for a gadget related to {t}.",
           "Draft a friendly email inviting colleagues to a talk on {t}.", "Write a short story that involves {t}.",
           "Write a catchy slogan and a two-sentence pitch for a campaign about {t}.",
           "Write a haiku and a limerick about {t}.", "Write an opening paragraph for a travel magazine article about {t}.",
           "Write a letter to a friend describing your new interest in {t}."]
STEM = ["Explain {t} in simple terms.", "What is {t}? Give three key facts.", "How does {t} work?",
        "Explain {t} to a ten-year-old.", "What are the main advantages and disadvantages of {t}?",
        "Describe the history of {t} in a few paragraphs.", "What are common misconceptions about {t}?",
        "Give me a step-by-step overview of {t}.", "Compare {t} and {u}.", "Why is {t} important?"]
ROLEPLAY = ["Pretend you are a tour guide. Introduce visitors to {t}.",
            "Act as a professor and give a short lecture on {t}.",
            "You are a detective. Describe how {t} helped you solve a case.",
            "Imagine you are a chef. Describe a dish inspired by {t}.",
            "Role-play as a customer support agent answering a question about {t}.",
            "Pretend to be a time traveler from the year 1800 seeing {t} for the first time.",
            "You are a motivational coach. Give a pep talk that mentions {t}."]
HUMANITIES = ["Discuss the cultural impact of {t}.", "How has {t} shaped modern society?",
              "What can we learn from {t}?", "Summarize the debate around {t}.",
              "What ethical questions does {t} raise?", "Write a short essay on {t} and {u}."]
FOLLOW_UPS = ["Rewrite your previous answer in fewer than 50 words.", "Now make it more formal.",
              "Can you give a concrete example?", "Summarize that as a bulleted list.",
              "Explain it again for a child.", "What are the main points again, in one sentence each?",
              "Now write a title for it.", "Add a short conclusion."]
MATH_TEMPLATES = [
    "If a shirt costs ${a} and is discounted by {p}%, what is the new price?",
    "A train travels {a} km in {b} hours. What is its average speed?",
    "What is {a} multiplied by {b}? Show your work.",
    "Solve for x: {a}x + {b} = {c}.",
    "A rectangle has a length of {a} cm and a width of {b} cm. What are its area and perimeter?",
    "Alice has {a} apples. She gives {b} to Bob and buys {c} more. How many apples does she have?",
    "What is the sum of all integers from 1 to {a}?",
    "Is {a} a prime number? Explain.",
    "A recipe needs {b} eggs for {a} cookies. How many eggs for {c} cookies?",
    "What is {p}% of {a}?",
]
REASONING = [
    "If all {x} are {y} and some {y} are {z}, can we conclude that some {x} are {z}? Explain.",
    "Tom is taller than Ann, and Ann is taller than Sam. Who is the shortest? Explain your reasoning.",
    "There are {a} people in a room and each shakes hands with every other person once. How many handshakes?",
    "Which is heavier, a kilogram of {x} or a kilogram of {y}? Explain.",
    "If today is {d}, what day of the week will it be in {a} days?",
]
NOUNS = ["cats", "birds", "teachers", "engineers", "apples", "cars", "musicians", "students", "trees", "robots"]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
CODING_CHAT = ["Write a Python function that {d}", "How would I {d_lower} in Python? Show code.",
               "Write a function in Python to {d_lower}. Include a docstring and an example.",
               "Implement this in Python: {d}"]
CODE_TASKS = """reverse a string; check whether a string is a palindrome; compute the factorial of n; return the
n-th Fibonacci number; merge two sorted lists; find the largest element in a list; count the vowels in a string;
remove duplicates from a list while keeping order; flatten a nested list; compute the greatest common divisor of
two numbers; check if a number is prime; sort a list of dictionaries by a key; read a CSV file and sum a column;
count word frequencies in a text; convert Celsius to Fahrenheit; find the second largest number in a list;
transpose a matrix; check if two strings are anagrams; generate all permutations of a list; compute the mean and
median of a list; validate an email address with a regular expression; implement binary search; implement a stack
class; implement a queue using two stacks; find the longest common prefix of strings; rotate a list by k
positions; compute the running sum of a list; chunk a list into groups of n; parse a date string; find all pairs
that sum to a target""".replace("\n", " ")


def _topics() -> list[str]:
    return [t.strip() for t in TOPICS.split(";") if t.strip()]


def build_prompts(total: int, seed: int = 0) -> list[TrainingPrompt]:
    """``total`` prompts in a fixed mix (see DATA_MIX), shuffled deterministically."""
    rng = random.Random(seed)
    topics = _topics()
    functions = stdlib_functions()
    rng.shuffle(functions)
    mans = man_summaries()
    rng.shuffle(mans)
    tasks = [t.strip() for t in CODE_TASKS.split(";") if t.strip()]

    def pick_topic_pair():
        t, u = rng.sample(topics, 2)
        return {"t": t, "u": u}

    def numbers():
        return {"a": rng.randint(2, 250), "b": rng.randint(2, 40), "c": rng.randint(2, 500), "p": rng.choice([5, 10, 15, 20, 25, 30, 40, 50]),
                "x": rng.choice(NOUNS), "y": rng.choice(NOUNS), "z": rng.choice(NOUNS), "d": rng.choice(DAYS)}

    makers = {
        "code-completion": lambda i: TrainingPrompt("code-completion", code_completion_prompt(*functions[i % len(functions)], rng), False),
        "code-chat": lambda i: _code_chat(functions, tasks, i, rng),
        "explain-api": lambda i: _explain_api(functions[(i * 7 + 3) % len(functions)], rng),
        "man": lambda i: _man_prompt(mans[i % len(mans)], rng) if mans else _explain_api(functions[i % len(functions)], rng),
        "writing": lambda i: TrainingPrompt("writing", rng.choice(WRITING).format(**pick_topic_pair()), True),
        "stem": lambda i: TrainingPrompt("stem", rng.choice(STEM).format(**pick_topic_pair()), True),
        "roleplay": lambda i: TrainingPrompt("roleplay", rng.choice(ROLEPLAY).format(**pick_topic_pair()), True),
        "humanities": lambda i: TrainingPrompt("humanities", rng.choice(HUMANITIES).format(**pick_topic_pair()), True),
        "math": lambda i: TrainingPrompt("math", rng.choice(MATH_TEMPLATES).format(**numbers()), True),
        "reasoning": lambda i: TrainingPrompt("reasoning", rng.choice(REASONING).format(**numbers()), True),
        "extraction": lambda i: _extraction(functions[(i * 13 + 5) % len(functions)], rng),
    }
    prompts: list[TrainingPrompt] = []
    for source, share in DATA_MIX.items():
        count = round(total * share)
        prompts.extend(makers[source](i) for i in range(count))
    rng.shuffle(prompts)
    return prompts[:total]


# Shares of prompts per source: about half code (HumanEval-like completion and chat coding), half chat
# across the kinds of requests people send.
DATA_MIX = {"code-completion": 0.34, "code-chat": 0.08, "explain-api": 0.06, "man": 0.05, "writing": 0.11,
            "stem": 0.11, "roleplay": 0.06, "humanities": 0.06, "math": 0.06, "reasoning": 0.03, "extraction": 0.04}


def _code_chat(functions, tasks, i, rng) -> TrainingPrompt:
    if i % 2 == 0:
        d = tasks[(i // 2) % len(tasks)]
        text = rng.choice(CODING_CHAT).format(d=f"takes its input and will {d}.", d_lower=d)
    else:
        module, name, signature, doc = functions[(i * 11) % len(functions)]
        first = doc.splitlines()[0].rstrip(".")
        text = f"Write a Python function `{name}{signature}`: {first}."
    return TrainingPrompt("code-chat", text, True)


def _explain_api(fn, rng) -> TrainingPrompt:
    module, name, signature, doc = fn
    text = rng.choice([f"What does Python's `{module}.{name}` do? Give an example.",
                       f"Explain this Python docstring in plain words:\n\n{doc}",
                       f"How do I use `{module}.{name}{signature}`?"])
    return TrainingPrompt("explain-api", text, True)


def _man_prompt(entry, rng) -> TrainingPrompt:
    command, summary = entry
    text = rng.choice([f"What does the `{command}` command do? ({summary})",
                       f"Give me three example uses of the Unix command `{command}`, which is used to {summary}.",
                       f"Explain `{command}`: {summary}."])
    return TrainingPrompt("man", text, True)


def _extraction(fn, rng) -> TrainingPrompt:
    module, name, signature, doc = fn
    text = rng.choice([f"Extract the parameter names from this documentation and list them as JSON:\n\n{name}{signature}\n{doc}",
                       f"Summarize the following text in two sentences:\n\n{doc}",
                       f"From the text below, list every noun phrase that names a data type.\n\n{doc}"])
    return TrainingPrompt("extraction", text, True)


def follow_up(rng: random.Random) -> str:
    return rng.choice(FOLLOW_UPS)


def available_counts() -> dict:
    """How many distinct raw items each offline source has (for the model card)."""
    return {"stdlib_functions": len(stdlib_functions()), "man_pages": len(man_summaries()), "topics": len(_topics())}


if __name__ == "__main__":  # pragma: no cover - quick look
    for p in build_prompts(20):
        print(p.source, "|", p.text[:100].replace("\n", "\\n"))
    print(available_counts())
