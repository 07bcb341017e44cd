"""Place names: about 250 real cities and an unbounded pool of made-up ones, each in one split.

Made-up names cannot be memorised, so a model that gets them right has learned to copy the span it was given.
A name's split is decided by its core words (generic words such as "New", "Port" or "City" dropped), so
"Port Lima" and "Lima" always share one: a held-out name never appears inside a training one.
"""

from __future__ import annotations

import random

from kestrel.train.synth.episode import draw_in_split, split_of

REAL_PLACES = """
Beijing Shanghai Tokyo Osaka Kyoto Seoul Busan Singapore Bangkok Jakarta Manila Hanoi Delhi Mumbai Kolkata Chennai
Bangalore Hyderabad Karachi Lahore Dhaka Kathmandu Colombo Dubai Doha Riyadh Tehran Baghdad Istanbul Ankara Cairo
Alexandria Casablanca Tunis Algiers Lagos Accra Dakar Nairobi Kampala Addis_Ababa Johannesburg Cape_Town Durban
Luanda Kinshasa Harare Lusaka Paris Lyon Marseille London Manchester Liverpool Edinburgh Glasgow Berlin Munich
Hamburg Cologne Frankfurt Madrid Barcelona Valencia Seville Rome Milan Naples Turin Florence Venice Vienna Prague
Warsaw Krakow Budapest Bucharest Sofia Belgrade Zagreb Athens Thessaloniki Moscow Kyiv Minsk Riga Vilnius Tallinn
Stockholm Gothenburg Oslo Bergen Helsinki Copenhagen Aarhus Dublin Cork Lisbon Porto Amsterdam Rotterdam Brussels
Antwerp Zurich Geneva Basel Toronto Vancouver Montreal Calgary Ottawa Chicago Boston Seattle Denver Houston Dallas
Austin Miami Atlanta Phoenix Detroit Portland Nashville Memphis Baltimore Philadelphia Pittsburgh Cleveland
Minneapolis Springfield New_York Los_Angeles San_Francisco San_Diego Las_Vegas New_Orleans Salt_Lake_City
Mexico_City Guadalajara Monterrey Havana Kingston Panama_City Bogota Medellin Quito Lima Cusco La_Paz Santiago
Valparaiso Buenos_Aires Cordoba Montevideo Asuncion Caracas Sao_Paulo Rio_de_Janeiro Brasilia Salvador Recife
Sydney Melbourne Brisbane Perth Adelaide Auckland Wellington Christchurch Reykjavik Tbilisi Yerevan Baku Almaty
Tashkent Ulaanbaatar Taipei Kaohsiung Hong_Kong Macau Shenzhen Guangzhou Chengdu Wuhan Xian Nanjing Hangzhou
Kuala_Lumpur Penang Phnom_Penh Vientiane Yangon Ho_Chi_Minh_City Cebu Bali Fukuoka Sapporo Nagoya Incheon
Vladivostok Novosibirsk Odesa Lviv Gdansk Wroclaw Bratislava Ljubljana Sarajevo Tirana Skopje Valletta Nicosia
Beirut Amman Jerusalem Muscat Kuwait_City Manama Abu_Dhabi Islamabad Kabul Marrakesh Fez Windhoek Gaborone
Maputo Antananarivo Mombasa Dar_es_Salaam Zanzibar Kigali Abuja Timbuktu Honolulu Anchorage Juneau Halifax
Quebec_City Winnipeg Edmonton Santo_Domingo San_Juan Tegucigalpa Managua San_Jose Guatemala_City Oaxaca Cancun
""".split()
NON_ASCII = [
    "São Paulo",
    "Zürich",
    "Kraków",
    "Reykjavík",
    "Málaga",
    "Düsseldorf",
    "Malmö",
    "Łódź",
    "Tromsø",
    "Göteborg",
]
REAL_PLACES = [p.replace("_", " ") for p in REAL_PLACES] + NON_ASCII + ["Jönköping", "Besançon"]
REAL_PLACES = [p for p in REAL_PLACES if p not in ("Sao Paulo", "Zurich", "Krakow", "Reykjavik")]

GENERIC_WORDS = frozenset("new san santa port lake saint fort mount city north south east west de da".split())

_ONSETS = "b c d f g h j k l m n p r s t v w z br ch dr gr kr pl sh st th tr".split()
_VOWELS = "a e i o u a e o ai ia ou".split()
_CODAS = [""] * 6 + "n r l s m k nd rt".split()
_EN_HEADS = "Spring Oak River Ash Maple Green Fair Kings Brook Stone Elm Wolf Red Silver Clear Pine Cedar Mill".split()
_EN_TAILS = "field ville ton burg port wood ford dale haven mouth bridge worth stead side view crest".split()
_PREFIXES = ["New", "Port", "Lake", "San", "Saint", "Fort", "Mount", "North", "West"]


def place_key(name: str) -> str:
    """The words that decide a name's split: its non-generic words, lower case."""
    words = [w for w in name.lower().split() if w not in GENERIC_WORDS]
    return " ".join(words) or name.lower()


def place_split(name: str) -> str:
    return split_of("place:" + place_key(name))


def _syllabic(rng: random.Random) -> str:
    syllables = [rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS) for _ in range(rng.choice([2, 2, 3]))]
    return "".join(syllables).capitalize()


def made_up_place(rng: random.Random) -> str:
    """A fresh name: syllables ("Tramokel"), an English compound ("Cedarworth"), or either behind a prefix."""
    core = _syllabic(rng) if rng.random() < 0.6 else rng.choice(_EN_HEADS) + rng.choice(_EN_TAILS)
    r = rng.random()
    if r < 0.15:
        return f"{rng.choice(_PREFIXES)} {core}"
    if r < 0.2:
        return f"{core} City"
    return core


def place(rng: random.Random, split: str, real_share: float = 0.5) -> str:
    """A place name in `split`: a real city with probability `real_share`, else a made-up one."""
    if rng.random() < real_share:
        pool = [p for p in REAL_PLACES if place_split(p) == split]
        return rng.choice(pool)
    return draw_in_split(rng, split, made_up_place, lambda name: "place:" + place_key(name))
