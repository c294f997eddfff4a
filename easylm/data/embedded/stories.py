"""A deterministic generator of small English-like documents.

The text is built for a model that must learn something visible within minutes on
two CPU cores: a vocabulary of a few hundred words, sentences from a few dozen
templates, and structure worth learning beyond word frequencies -- a character's
name and pronoun recur through a story, counts follow simple arithmetic, each
animal keeps the same facts in every document, and answers repeat their question.
Chat transcripts, in the embedded chat template, teach the format the server prompts
with: a story asked for about a cat is about a cat.
"""

import random

from easylm.data import embedded

NAMES = {
    "she": ["Lily", "Mia", "Anna", "Sara", "Emma", "Lucy", "Nora", "Ella", "Zoe", "Ruby",
            "Ivy", "Rosa"],
    "he": ["Tom", "Ben", "Max", "Leo", "Sam", "Jack", "Finn", "Owen", "Theo", "Eli",
           "Noah", "Hugo"],
}
# Each animal keeps its own facts everywhere: (sound, food, home, ability, colour).
ANIMALS = {
    "cat": ("meow", "fish", "a warm house", "climb trees", "grey"),
    "dog": ("woof", "bones", "a small kennel", "run fast", "brown"),
    "duck": ("quack", "bread", "a quiet pond", "swim", "yellow"),
    "cow": ("moo", "grass", "a big barn", "give milk", "black and white"),
    "frog": ("ribbit", "flies", "a green pond", "jump high", "green"),
    "owl": ("hoot", "mice", "an old tree", "see at night", "brown"),
    "pig": ("oink", "apples", "a muddy farm", "dig in the mud", "pink"),
    "bee": ("buzz", "nectar", "a busy hive", "make honey", "yellow and black"),
    "horse": ("neigh", "hay", "a red stable", "carry people", "white"),
    "mouse": ("squeak", "cheese", "a tiny hole", "hide well", "grey"),
    "bird": ("tweet", "seeds", "a high nest", "fly", "blue"),
    "bear": ("growl", "honey", "a dark cave", "catch fish", "brown"),
}
ADJECTIVES = ["little", "happy", "brave", "curious", "kind", "sleepy", "small", "funny",
              "shy", "clever", "gentle", "busy"]
PLACES = ["in a small town", "near the sea", "on a farm", "in a big forest",
          "by a river", "on a green hill", "in a quiet village", "near the park"]
THINGS = ["ball", "kite", "box", "hat", "book", "cup", "shell", "stone", "key", "flower",
          "drum", "boat"]
COLOURS = ["red", "blue", "green", "yellow", "shiny", "tiny", "big", "soft"]
ACTIVITIES = ["play in the garden", "read books", "sing songs", "look at the stars",
              "draw pictures", "run in the park", "build towers", "help at home"]
FEELINGS = ["happy", "proud", "glad", "calm", "excited", "thankful"]
FRUITS = ["apples", "pears", "plums", "cookies", "cakes", "berries", "eggs", "nuts"]
NUMBERS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight",
           "nine", "ten", "eleven", "twelve"]
SEASONS = ["spring", "summer", "autumn", "winter"]
WEATHER = {"spring": "rainy", "summer": "hot", "autumn": "windy", "winter": "cold"}


def _a(word):
    return ("an " if word[0] in "aeiou" else "a ") + word


def _plural(animal):
    return {"mouse": "mice"}.get(animal, animal + "s")


def _character(rng):
    pronoun = rng.choice(["she", "he"])
    return rng.choice(NAMES[pronoun]), pronoun


def story(rng, animal=None, name=None):
    """A story; `animal` and `name`, when given, are its hero's (what a chat asked for)."""
    if name is None:
        name, he = _character(rng)
    else:
        he = next(pronoun for pronoun, names in NAMES.items() if name in names)
    friend, friend_he = _character(rng)
    while friend == name:
        friend, friend_he = _character(rng)
    animal = animal or rng.choice(sorted(ANIMALS))
    animal2 = rng.choice(sorted(set(ANIMALS) - {animal}))
    thing, colour = rng.choice(THINGS), rng.choice(COLOURS)
    his = {"she": "her", "he": "his"}[he]
    lines = [
        f"Once upon a time, there was {_a(rng.choice(ADJECTIVES))} {animal} named {name}.",
        f"{name} lived {rng.choice(PLACES)}.",
        f"Every day, {he} liked to {rng.choice(ACTIVITIES)}.",
        rng.choice([
            f"One day, {name} found {_a(colour)} {thing}.",
            f"One morning, {name} lost {his} {colour} {thing}.",
        ]),
        rng.choice([
            f"Then {name} met {_a(animal2)} named {friend}.",
            f"Soon {_a(animal2)} named {friend} came to say hello.",
        ]),
        f"\"Hello, {friend}!\" said {name}. \"Hello, {name}!\" said {friend}.",
        f"The {animal2} said \"{ANIMALS[animal2][0]}\" and the {animal} said "
        f"\"{ANIMALS[animal][0]}\".",
        rng.choice([
            f"{name} and {friend} played with the {thing} all day.",
            f"{friend} helped {name} look for the {thing}, and they found it under a tree.",
            f"{name} gave the {thing} to {friend}, and {friend_he} smiled.",
        ]),
        f"At the end of the day, {name} felt {rng.choice(FEELINGS)}.",
        "The end.",
    ]
    return " ".join(lines)


def counting(rng):
    name, he = _character(rng)
    friend, _ = _character(rng)
    while friend == name:
        friend, _ = _character(rng)
    fruit = rng.choice(FRUITS)
    total = rng.randint(2, 12)
    given = rng.randint(1, total)
    found = rng.randint(0, 12 - (total - given))
    He = he.capitalize()
    lines = [
        f"{name} had {NUMBERS[total]} {fruit}.",
        f"{He} gave {NUMBERS[given]} {fruit} to {friend}.",
        f"Now {name} has {NUMBERS[total - given]} {fruit} and {friend} has "
        f"{NUMBERS[given]} {fruit}.",
    ]
    if found:
        lines += [f"Then {name} found {NUMBERS[found]} more {fruit}.",
                  f"Now {name} has {NUMBERS[total - given + found]} {fruit}."]
    return " ".join(lines)


def facts(rng):
    animals = rng.sample(sorted(ANIMALS), rng.randint(2, 4))
    lines = []
    for animal in animals:
        sound, food, home, ability, colour = ANIMALS[animal]
        lines += rng.sample([
            f"{_a(animal).capitalize()} says \"{sound}\".",
            f"{_a(animal).capitalize()} likes to eat {food}.",
            f"{_a(animal).capitalize()} lives in {home}.",
            f"{_a(animal).capitalize()} can {ability}.",
            f"Most {_plural(animal)} are {colour}.",
        ], 3)
    return " ".join(lines)


def questions(rng):
    pairs = []
    for _ in range(rng.randint(2, 4)):
        animal = rng.choice(sorted(ANIMALS))
        sound, food, home, ability, colour = ANIMALS[animal]
        season = rng.choice(SEASONS)
        pairs.append(rng.choice([
            (f"What does {_a(animal)} say?", f"{_a(animal).capitalize()} says \"{sound}\"."),
            (f"What does {_a(animal)} eat?", f"{_a(animal).capitalize()} eats {food}."),
            (f"Where does {_a(animal)} live?", f"{_a(animal).capitalize()} lives in {home}."),
            (f"What can {_a(animal)} do?", f"{_a(animal).capitalize()} can {ability}."),
            (f"What is the weather like in {season}?", f"In {season} it is often "
             f"{WEATHER[season]}."),
        ]))
    return " ".join(f"Q: {q} A: {a}" for q, a in pairs)


def _ask(rng):
    """A request for a story, maybe naming its hero's animal, name or both: (text, animal,
    name), None where not named."""
    animal = rng.choice(sorted(ANIMALS)) if rng.random() < 0.75 else None
    name = rng.choice(NAMES[rng.choice(["she", "he"])]) if rng.random() < 0.3 else None
    about = f" about {_a(animal)}" if animal else ""
    if name:
        about += f" named {name}" if animal else f" about {name}"
    ask = rng.choice(["Tell me a story", "Please tell me a story", "Can you tell me a story"])
    end = "?" if ask.startswith("Can") else rng.choice([".", "!", ""])
    return ask + about + end, animal, name


def chat_messages(rng):
    """A conversation: a user asks for a story (one time in four, twice), the assistant
    tells one with the hero asked for."""
    messages = []
    for _ in range(2 if rng.random() < 0.25 else 1):
        text, animal, name = _ask(rng)
        messages += [{"role": "user", "content": text},
                     {"role": "assistant", "content": story(rng, animal, name)}]
    return messages


def chat(rng):
    """A conversation as the server's chat template renders it."""
    return embedded.chat_document(chat_messages(rng))


KINDS = [(story, 4), (counting, 2), (facts, 2), (questions, 2), (chat, 6)]


def documents(num_documents, seed=0):
    """Yield `num_documents` texts; the same seed always gives the same texts."""
    rng = random.Random(seed)
    kinds = [kind for kind, weight in KINDS for _ in range(weight)]
    for _ in range(num_documents):
        yield rng.choice(kinds)(rng)
