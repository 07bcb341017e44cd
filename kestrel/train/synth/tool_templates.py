"""How users ask for each tool: training phrasings and held-out ones (never used for training), plus slot words.

Held-out phrasings differ in structure, not just punctuation (a test checks they are distinct after
normalisation). The phrasings from the original data set stay in training.
"""

from __future__ import annotations

# intent → (training phrasings, held-out phrasings)
TEMPLATES: dict[str, tuple[list[str], list[str]]] = {
    "weather": (
        [
            "What's the weather in {city}?",
            "What is the weather like in {city}?",
            "How is the weather in {city}?",
            "Tell me the weather in {city}.",
            "weather in {city}?",
            "How hot is it in {city}?",
            "Is it cold in {city} today?",
            "What's the forecast for {city}?",
            "Can you tell me the weather in {city}?",
            "I'm heading to {city}. What's the weather there?",
            "Do I need an umbrella in {city}?",
            "Please get the current weather for {city}.",
            "Is it sunny in {city}?",
            "{city} weather",
            "How warm is it in {city} at the moment?",
            "Check the weather in {city}, please.",
        ],
        [
            "Could you check the weather in {city} for me?",
            "Is it raining in {city} right now?",
            "What are the weather conditions in {city}?",
            "I'd like to know the weather in {city}.",
            "Any idea what the weather is doing in {city}?",
            "Give me the current weather for {city}.",
        ],
    ),
    "weather_unit": (
        [
            "What's the weather in {city} in {unit}?",
            "Tell me the temperature in {city} in {unit}.",
            "How hot is it in {city}? Answer in {unit}.",
            "weather in {city} in {unit}",
            "Can you get the weather for {city} in {unit}?",
            "What is the temperature in {city}, in {unit} please?",
        ],
        [
            "Could you check the weather in {city} in {unit} for me?",
            "I'd like the weather in {city}, shown in {unit}.",
            "Using {unit}, what's the weather in {city}?",
        ],
    ),
    "time": (
        [
            "What time is it in {city}?",
            "What's the local time in {city}?",
            "Tell me the time in {city}.",
            "current time in {city}?",
            "What's the time in {city} at the moment?",
            "Can you tell me what time it is in {city}?",
            "I need the local time in {city}.",
            "time in {city}",
            "Is it morning in {city} yet?",
            "What hour is it in {city}?",
            "Please check the clock in {city}.",
        ],
        [
            "Could you look up the time in {city} for me?",
            "Do you know the current time in {city}?",
            "What's the clock saying in {city}?",
            "How late is it in {city} now?",
            "Give me the local time for {city}.",
        ],
    ),
    "population": (
        [
            "What is the population of {city}?",
            "How many people live in {city}?",
            "What's the population of {city}?",
            "population of {city}?",
            "How big is {city} by population?",
            "Tell me how many people live in {city}.",
            "Can you find the population of {city}?",
            "{city} population",
            "How populous is {city}?",
            "What is the number of inhabitants of {city}?",
        ],
        [
            "Could you look up how many people live in {city}?",
            "Roughly how many residents does {city} have?",
            "I wonder what the population of {city} is.",
            "How many inhabitants are there in {city}?",
            "Give me the population figure for {city}.",
        ],
    ),
    "directions": (
        [
            "How do I get from {origin} to {destination}?",
            "Directions from {origin} to {destination}, please.",
            "What's the route from {origin} to {destination}?",
            "Give me directions from {origin} to {destination}.",
            "I need to go from {origin} to {destination}.",
            "How far is {destination} from {origin}?",
            "Find a route from {origin} to {destination}.",
            "route {origin} to {destination}",
            "Navigate from {origin} to {destination}.",
        ],
        [
            "Could you plan a trip from {origin} to {destination} for me?",
            "What's the best way to travel from {origin} to {destination}?",
            "I'm in {origin}. How do I reach {destination}?",
            "Show me how to get to {destination} starting from {origin}.",
        ],
    ),
    "directions_mode": (
        [
            "How do I get from {origin} to {destination} {mode}?",
            "Directions from {origin} to {destination} {mode}, please.",
            "What's the route from {origin} to {destination} {mode}?",
            "I want to go from {origin} to {destination} {mode}.",
        ],
        [
            "Could you plan a trip from {origin} to {destination} {mode} for me?",
            "I'm in {origin}. How do I reach {destination} {mode}?",
        ],
    ),
    "units": (
        [
            "Convert {value} {from} to {to}.",
            "How many {to} is {value} {from}?",
            "What is {value} {from} in {to}?",
            "{value} {from} in {to}?",
            "Change {value} {from} into {to}.",
            "How much is {value} {from} in {to}?",
            "Please convert {value} {from} into {to}.",
            "{value} {from} to {to}",
        ],
        [
            "Could you turn {value} {from} into {to} for me?",
            "I have {value} {from}. How many {to} is that?",
            "Express {value} {from} in {to}.",
            "What does {value} {from} come to in {to}?",
        ],
    ),
    "currency": (
        [
            "Convert {value} {from} to {to}.",
            "How much is {value} {from} in {to}?",
            "What is {value} {from} in {to}?",
            "{value} {from} to {to}",
            "Exchange {value} {from} into {to}.",
            "How many {to} do I get for {value} {from}?",
            "Please change {value} {from} into {to}.",
        ],
        [
            "Could you tell me what {value} {from} is worth in {to}?",
            "I want to swap {value} {from} for {to}. How much is that?",
            "What's the value of {value} {from} in {to}?",
        ],
    ),
    "search": (
        [
            "Search the web for {query}.",
            "Look up {query} online.",
            "Can you search for {query}?",
            "Google {query}.",
            "Find information about {query}.",
            "search {query}",
            "I want to read about {query}. Search it.",
            "Please do a web search for {query}.",
            "Find me web results for {query}.",
        ],
        [
            "Could you find something online about {query} for me?",
            "Run a search on {query}.",
            "What does the internet say about {query}?",
            "Browse the web for {query}, please.",
        ],
    ),
    "stock": (
        [
            "What's the stock price of {symbol}?",
            "How is {symbol} trading?",
            "Get me the latest price of {symbol}.",
            "{symbol} stock price",
            "What is {symbol} trading at?",
            "Check the share price of {symbol}.",
            "price of {symbol} stock?",
            "How much is one share of {symbol}?",
        ],
        [
            "Could you look up the share price of {symbol} for me?",
            "Where is {symbol} trading today?",
            "What does {symbol} cost per share right now?",
        ],
    ),
    "email": (
        [
            "Email {to} saying {body}.",
            "Send an email to {to}: {body}",
            "Write to {to} that {body}.",
            "Send {to} a message saying {body}.",
            "Please email {to} and tell them {body}.",
            "Mail {to}: {body}",
            "Shoot an email to {to} saying {body}.",
        ],
        [
            "Could you drop {to} a line saying {body}?",
            "Let {to} know by email that {body}.",
            "Compose an email to {to} that says {body}.",
        ],
    ),
    "timer": (
        [
            "Set a timer for {minutes} minutes.",
            "Start a {minutes} minute timer.",
            "Timer for {minutes} minutes, please.",
            "Can you set a {minutes}-minute timer?",
            "Count down {minutes} minutes for me.",
            "set timer {minutes} min",
            "Please time {minutes} minutes.",
        ],
        [
            "Could you start a countdown of {minutes} minutes for me?",
            "I need a timer that goes off in {minutes} minutes.",
            "Wake me in {minutes} minutes with a timer.",
        ],
    ),
    "calculator": (
        [
            "What is {a} {op} {b}?",
            "Calculate {a} {op} {b}.",
            "Use the calculator: {a} {op} {b}",
            "{a} {op} {b} = ?",
            "Compute {a} {op} {b}.",
            "how much is {a} {op} {b}",
            "Work out {a} {op} {b} with the calculator.",
        ],
        [
            "Could you run {a} {op} {b} through the calculator?",
            "I need the result of {a} {op} {b}.",
            "What does {a} {op} {b} come to?",
        ],
    ),
}

# Slot words: what users write → the argument value the call carries.
TEMPERATURE_WORDS = {"celsius": ["Celsius", "celsius", "°C"], "fahrenheit": ["Fahrenheit", "fahrenheit", "°F"]}
MODE_WORDS = {
    "driving": ["by car", "driving"],
    "walking": ["on foot", "walking"],
    "transit": ["by bus", "by train", "on public transport"],
}
UNIT_WORDS = {
    "km": ["km", "kilometers", "kilometres"],
    "mi": ["miles", "mi"],
    "m": ["meters", "metres", "m"],
    "ft": ["feet", "ft"],
    "kg": ["kg", "kilograms", "kilos"],
    "lb": ["pounds", "lbs", "lb"],
    "g": ["grams", "g"],
    "oz": ["ounces", "oz"],
    "l": ["liters", "litres", "L"],
    "gal": ["gallons", "gal"],
    "c": ["degrees Celsius", "°C"],
    "f": ["degrees Fahrenheit", "°F"],
}
CURRENCY_WORDS = {
    "USD": ["dollars", "USD", "US dollars"],
    "EUR": ["euros", "EUR"],
    "GBP": ["British pounds", "GBP", "pounds sterling"],
    "JPY": ["yen", "JPY"],
    "CNY": ["yuan", "CNY", "renminbi"],
    "INR": ["rupees", "INR"],
    "CHF": ["Swiss francs", "CHF"],
    "CAD": ["Canadian dollars", "CAD"],
}
CALC_WORDS = {"+": ["+", "plus"], "-": ["-", "minus"], "*": ["*", "x", "times"], "/": ["/", "divided by"]}

QUERY_PATTERNS = [
    "best {food} in {place}",
    "history of {place}",
    "{place} travel tips",
    "museums in {place}",
    "cheap flights to {place}",
    "how to {task}",
    "{thing} reviews",
    "news about {thing}",
    "where to buy {thing}",
]
FOODS = "pizza sushi tacos coffee ramen dumplings curry bagels noodles ice cream falafel pastries".split(" ")
TASKS = [
    "fix a bike chain",
    "bake bread",
    "learn the guitar",
    "plant tomatoes",
    "tie a tie",
    "clean a laptop fan",
    "write a cover letter",
    "train a puppy",
    "brew tea",
    "change a tire",
    "fold a paper crane",
    "start running",
    "paint a wall",
    "save for a house",
]
THINGS = [
    "electric cars",
    "solar panels",
    "running shoes",
    "board games",
    "noise cancelling headphones",
    "mechanical keyboards",
    "the local football team",
    "vintage cameras",
    "house plants",
    "e-readers",
    "camping tents",
    "standing desks",
]
EMAIL_BODIES = [
    "I will be late",
    "the meeting moved to {day}",
    "see you in {place}",
    "the report is ready",
    "thanks for the help",
    "dinner is at {hour} pm",
    "I am running {n} minutes late",
    "the package arrived",
    "happy birthday",
    "call me when you land in {place}",
    "the tickets for {place} are booked",
    "I left my keys at home",
]
DAYS = "Monday Tuesday Wednesday Thursday Friday Saturday Sunday".split()
FIRST_NAMES = (
    "alice bob carol dave erin frank grace heidi ivan judy kofi lena mateo nadia omar priya quinn rosa sven tariq "
    "uma victor wei xena yusuf zoe"
).split()
LAST_NAMES = "smith garcia chen okafor novak silva kim patel rossi müller jensen haddad".split()
DOMAINS = ["example.com", "mail.com", "work.org", "inbox.net"]
