"""Built-in vocabularies for the offline workloads: no downloads, deterministic per seed.

RULER draws its word keys ("adjective-noun") and its common-word lists from the `wonderwords`
package. Here they come from the lists below (about 300 adjectives x 400 nouns = 120,000 keys),
and `pseudo_words` extends the vocabulary with pronounceable invented words when a task needs
more distinct words than the lists hold (CWE at 1M tokens needs tens of thousands).
"""

from __future__ import annotations

import random
import string
import uuid
from functools import cache


def _words(text: str) -> tuple[str, ...]:
    return tuple(text.split())


ADJECTIVES = _words(
    """
able absent acid active actual adorable agile alert alive amber ample ancient angry antique anxious
arctic aromatic ashen awake awful azure bald barren basic bitter bland bleak blind blissful blue
blunt bold bony brave brief bright brisk broad broken bronze brown bumpy busy calm candid careful
casual cheap cheerful chilly chubby civic clean clear clever cloudy clumsy coarse cold colossal
common compact cool coral cosmic cozy crafty crimson crisp cruel curly curved cute damp dark
dazzling dear decent deep dense dim dirty distant dizzy dry dull dusty eager early earnest easy
elastic elder electric elegant empty endless epic equal exact exotic faded faint fair faithful false
famous fancy fast fearless feeble fertile fierce fine firm flat fluffy fond foggy formal fragile
frank free fresh friendly frosty frozen funny fuzzy gentle giant gifted glad gleaming glossy golden
graceful grand gray great grim gritty grumpy hairy handsome happy hard harsh hasty hazy healthy
heavy hidden high hollow homely honest hot huge humble hungry icy idle immense innocent jagged jolly
juicy keen kind large late lavish lazy lean light lively lonely long loose loud lovely loyal lucky
lunar magic major mellow merry mighty mild minor misty modern modest moist moral muddy narrow nasty
neat nervous new nimble noble noisy normal numb odd old orange ornate pale patient perfect plain
pleasant plump polite poor precious proud purple quick quiet radiant rapid rare raw ready real regal
rich rigid ripe rough round royal rude rural rustic sacred salty sandy scarlet secret serene shaggy
sharp shiny short shy silent silky silver simple sleepy slim slow small smart smooth snowy soft
solar solid sour spare spicy splendid steady steep sticky stiff stormy strange strict strong sturdy
subtle sudden sunny super sweet swift tall tame tart tender thick thin thirsty tidy tiny tough
tranquil tropical true ugly urban vacant vague valid vast velvet vivid warm wary weak weary wet white
whole wicked wide wild windy wise witty wooden young zealous
"""
)

NOUNS = _words(
    """
acorn actor airport album anchor angle animal ankle apple apron arch arena armor arrow artist atlas
attic author avenue badge bakery balcony ball bamboo banana band banner barn barrel basket battery
beach beacon bean bear beard bell belt bench berry bicycle biscuit blanket blossom boat bone book
boot bottle boulder bowl box bracelet branch bread brick bridge broom brush bubble bucket buffalo
bugle building bunny butter button cabin cactus cake camel camera canal candle canoe canvas canyon
captain car carpet carrot castle cat cathedral cave cedar cellar chair chalk channel cheese cherry
chest chimney circle city cliff clock cloud clover coast coat cobra coconut coffee coin comet compass
cookie copper corner cottage cotton couch country cow crab crane crayon creek cricket crown crystal
cup curtain cushion daisy dancer deer desert desk diamond dinosaur dolphin donkey door dragon drawer
dream drum duck eagle earth eel elbow elephant elm engine envelope falcon farm feather fence fern
ferry field fig finger fire fish flag flame flute forest fork fountain fox frog garden garlic gate gem
ghost giraffe glacier glass glove goat gold goose grape grass guitar hammer harbor harp hat hawk
hedge helmet hill hive honey horizon horse hotel house island ivy jacket jaguar jar jellyfish jewel
jungle kangaroo kettle key kingdom kite kitten knife ladder lake lamp lantern laptop leaf lemon
leopard letter library lighthouse lily lion lizard lobster lock locket magnet mango map maple marble
market meadow melon mirror mitten monkey moon moose mountain mouse mushroom needle nest net notebook
nut oak oar ocean octopus office olive onion orchard orchid otter owl oyster paddle painter palace
palm panda paper parrot peach pear pearl pebble pelican pencil penguin pepper piano pigeon pillow
pine planet plate plum pond poppy potato pumpkin puppet puzzle quarry quilt rabbit raccoon radio
rainbow raven reef ribbon river road robin rocket roof rose ruby saddle sail salmon sandal satellite
scarf school scooter seal seed shark sheep shell ship shoe shovel silk singer skate sled slipper
snail snake socket sofa spider spoon squirrel stable stadium star statue stone storm stove
strawberry stream street sugar suitcase summit sun swan sweater table tablet teapot tent theater
thimble thunder tiger timber tomato tower tractor trail train tree trumpet tulip tunnel turtle
umbrella valley vase violin volcano wagon wallet walnut walrus wand watch waterfall whale wheel
whistle willow window wolf yacht zebra
"""
)

# Base forms; `third_person` inflects them.
VERBS = _words(
    """
admire avoid borrow build change choose consider copy create defend discover doubt earn expect
explain finish fix follow ignore imagine improve learn like make measure miss need notice predict
prefer protect push question reach reject remember repeat replace respect reward shape solve start
study teach test trust try understand value want waste watch write
"""
)

ADVERBS = _words(
    """
quietly rarely often usually slowly quickly eventually suddenly gradually seldom naturally clearly
honestly surprisingly certainly probably mostly barely deliberately carefully
"""
)

# Abstract nouns for essay-like prose (singular; `plural` inflects them).
TOPICS = _words(
    """
idea problem company founder habit question mistake market user investor program language essay
city school teacher student friend writer reader project product startup customer decision design
experiment tool rule theory leader manager hacker painter scientist book plan feature risk goal
reason belief skill job team argument pattern opportunity
"""
)


def third_person(verb: str) -> str:
    """'watch' -> 'watches', 'study' -> 'studies', 'make' -> 'makes'."""
    if verb.endswith(("s", "sh", "ch", "x", "z")):
        return verb + "es"
    if verb.endswith("y") and verb[-2] not in "aeiou":
        return verb[:-1] + "ies"
    return verb + "s"


def plural(noun: str) -> str:
    """'company' -> 'companies', 'box' -> 'boxes', 'idea' -> 'ideas'."""
    return third_person(noun)


@cache
def word_keys() -> tuple[str, ...]:
    """All "adjective-noun" needle keys, sorted (RULER's `words` needle type)."""
    return tuple(sorted({f"{a}-{n}" for a in ADJECTIVES for n in NOUNS}))


@cache
def real_words() -> tuple[str, ...]:
    """Distinct real words of the lists above, sorted."""
    return tuple(sorted(set(ADJECTIVES) | set(NOUNS) | set(VERBS) | set(ADVERBS) | set(TOPICS)))


_ONSETS = ("b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "st", "tr", "pl")
_VOWELS = ("a", "e", "i", "o", "u", "ai", "ou")
_CODAS = ("", "", "", "n", "r", "l", "s", "m")


def pseudo_words(count: int, seed: int, exclude: frozenset[str] = frozenset()) -> list[str]:
    """`count` distinct pronounceable invented words (2-3 syllables), deterministic per seed."""
    rng = random.Random(f"pseudo-words:{seed}")
    out: list[str] = []
    seen = set(exclude)
    while len(out) < count:
        w = "".join(
            rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS) for _ in range(rng.randint(2, 3))
        )
        if w not in seen:
            seen.add(w)
            out.append(w)
    return out


@cache
def longest_word() -> int:
    """The most letters any word of `vocabulary` can have: a real word's, or three of the longest
    syllables an invented word is made of."""
    syllable = max(map(len, _ONSETS)) + max(map(len, _VOWELS)) + max(map(len, _CODAS))
    return max(max(map(len, real_words())), 3 * syllable)


def vocabulary(count: int, seed: int) -> list[str]:
    """`count` distinct words: the real words first (shuffled per seed), then invented ones."""
    words = list(real_words())
    random.Random(f"vocabulary:{seed}").shuffle(words)
    if count > len(words):
        words += pseudo_words(count - len(words), seed, frozenset(words))
    return words[:count]


def random_number(rng: random.Random, digits: int = 7) -> str:
    """A `digits`-digit decimal number without a leading zero (RULER's `numbers` needles)."""
    return str(rng.randint(10 ** (digits - 1), 10**digits - 1))


def random_uuid(rng: random.Random) -> str:
    """A random version-4 UUID string (RULER's `uuids` needles)."""
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def random_word_key(rng: random.Random) -> str:
    """A random "adjective-noun" key (RULER's `words` needles)."""
    keys = word_keys()
    return keys[rng.randrange(len(keys))]


def random_needle(kind: str, rng: random.Random) -> str:
    """A random needle key or value of `kind` ('numbers', 'uuids' or 'words')."""
    if kind == "numbers":
        return random_number(rng)
    if kind == "uuids":
        return random_uuid(rng)
    if kind == "words":
        return random_word_key(rng)
    raise ValueError(f"unknown needle kind {kind!r}")


def random_letters(rng: random.Random, k: int, alphabet: str = string.ascii_uppercase) -> str:
    """`k` random letters (variable names in VT, coded words in FWE)."""
    return "".join(rng.choices(alphabet, k=k))
