"""Word lists for the meaning-change guard (:mod:`carpool.semantic.guard`).

Everything here is general English, lower case, written as plain data so that it can be read and
extended without touching the rules. Words are given in their base form; the guard maps inflected
forms (plural, -ed, -ing, comparative -er/-est, adverb -ly) onto these before looking them up.
"""

from __future__ import annotations


def _words(text: str) -> frozenset[str]:
    return frozenset(text.split())


def _pairs(text: str) -> tuple[tuple[str, str], ...]:
    """``"a/b c/d"`` -> ``(("a", "b"), ("c", "d"))``; ``_`` in a word stands for a space."""
    out = []
    for item in text.split():
        left, right = item.split("/")
        out.append((left.replace("_", " "), right.replace("_", " ")))
    return tuple(out)


def _groups(text: str) -> tuple[frozenset[str], ...]:
    """One group a line, words separated by spaces."""
    return tuple(frozenset(line.split()) for line in text.strip().splitlines() if line.strip())


# --------------------------------------------------------------------------------------------
# Negation

#: Words that negate (after contractions are expanded: "isn't" -> "is not", "can't" -> "can not").
NEGATION_CUES = _words("""
    not no never without none nobody nothing nowhere neither nor hardly barely scarcely cannot
    nope nah
""")

#: Cues that are not counted: "nor" goes with "neither" (one negation, not two).
NEGATION_UNCOUNTED = _words("nor")

# Contractions. "'s" after these words is "is" ("it's", "what's"); after any other word it marks a
# possessive ("child's"). "let's" is "let us".
S_IS = _words("""
    it that what who where how there here he she this when why everything nothing something
    someone somebody everyone everybody anyone anybody one which
""")

CONTRACTIONS = {
    "can't": "can not", "cannot": "can not", "won't": "will not", "shan't": "shall not",
    "ain't": "is not", "let's": "let us",
    # common apostrophe-less spellings
    "dont": "do not", "doesnt": "does not", "didnt": "did not", "cant": "can not",
    "wont": "will not", "isnt": "is not", "arent": "are not", "wasnt": "was not",
    "werent": "were not", "havent": "have not", "hasnt": "has not", "hadnt": "had not",
    "shouldnt": "should not", "couldnt": "could not", "wouldnt": "would not",
    "mustnt": "must not", "neednt": "need not", "im": "i am", "ive": "i have",
    "youre": "you are", "youve": "you have", "theyre": "they are", "thats": "that is",
    "whats": "what is", "hows": "how is", "wheres": "where is", "whos": "who is",
    "theres": "there is",
}
SUFFIX_CONTRACTIONS = {"'re": "are", "'ve": "have", "'ll": "will", "'d": "would", "'m": "am"}

# --------------------------------------------------------------------------------------------
# Antonyms

#: Antonym pairs (base forms). Either direction counts. A pair whose words appear one on each side
#: (and not both on one side) is a polarity flip, which a negation on one side may cancel ("not
#: safe" = "dangerous"). Prefix antonyms (un-, in-, im-, il-, ir-, dis-, non-, de-, a-, anti-,
#: mis-) and -ful/-less are found by rule and need no entry here.
ANTONYM_PAIRS = _pairs("""
    safe/dangerous safe/unsafe safe/risky safe/harmful safe/toxic safe/hazardous safety/danger
    secure/insecure secure/vulnerable increase/decrease increase/reduce increase/lower increase/cut
    raise/lower raise/reduce rise/fall rise/drop rise/decline grow/shrink expand/shrink
    expand/contract expand/collapse inflate/deflate inflation/deflation appreciate/depreciate
    gain/lose gain/loss profit/loss boost/reduce boost/lower accelerate/decelerate accelerate/slow
    improve/worsen improve/degrade improve/deteriorate improvement/deterioration better/worse
    before/after prior/after earlier/later early/late previous/next last/next past/future
    yesterday/tomorrow ancient/modern old/new old/young beginning/end start/end start/finish
    start/stop begin/end begin/finish first/last open/close open/closed open/shut opening/closing
    cheap/expensive cheap/costly cheap/pricey inexpensive/expensive affordable/expensive
    low-cost/expensive budget/premium free/paid max/min maximum/minimum maximize/minimize
    maximise/minimise highest/lowest most/least most/fewest more/less more/fewer many/few
    much/little majority/minority add/remove add/delete add/subtract addition/subtraction
    plus/minus insert/delete insert/remove append/remove create/delete create/destroy build/destroy
    enable/disable allow/block allow/deny allow/forbid allow/prohibit allow/prevent permit/forbid
    permit/prohibit permit/deny grant/deny grant/revoke approve/reject approve/deny approve/decline
    accept/reject accept/decline accept/refuse admit/deny confirm/deny agree/disagree agree/refuse
    support/oppose pro/anti include/exclude inclusive/exclusive including/excluding include/omit
    buy/sell purchase/sell buyer/seller buying/selling import/export importer/exporter hot/cold
    warm/cold warm/cool hot/cool heat/cool heating/cooling heater/cooler boil/freeze freeze/thaw
    freeze/melt summer/winter high/low tall/short long/short big/small large/small huge/tiny
    giant/tiny wide/narrow broad/narrow thick/thin fat/thin fat/skinny fat/lean deep/shallow
    heavy/light strong/weak hard/soft hard/easy easy/difficult simple/complex simple/complicated
    simple/difficult basic/advanced beginner/advanced beginner/expert novice/expert
    amateur/professional junior/senior major/minor superior/inferior upper/lower top/bottom
    above/below overestimate/underestimate overweight/underweight overpaid/underpaid
    overrate/underrate overcook/undercook overflow/underflow inside/outside internal/external
    inner/outer indoor/outdoor interior/exterior input/output incoming/outgoing inbound/outbound
    upload/download upstream/downstream uplink/downlink upgrade/downgrade upvote/downvote
    upside/downside uphill/downhill upstairs/downstairs upward/downward ascend/descend
    ascending/descending push/pull send/receive sender/recipient sender/receiver deposit/withdraw
    deposit/withdrawal credit/debit income/expense income/expenditure revenue/expense
    asset/liability creditor/debtor arrive/depart arrive/leave arrival/departure enter/exit
    enter/leave entrance/exit entry/exit login/logout log_in/log_out sign_in/sign_out
    check_in/check_out opt_in/opt_out connect/disconnect attach/detach mount/unmount plug/unplug
    install/uninstall lock/unlock encrypt/decrypt encryption/decryption compress/decompress
    encode/decode encoder/decoder zip/unzip pack/unpack load/unload subscribe/unsubscribe
    follow/unfollow block/unblock activate/deactivate freeze/unfreeze mute/unmute pin/unpin
    hide/show hide/reveal show/conceal visible/hidden visible/invisible public/private
    mandatory/optional required/optional compulsory/optional necessary/unnecessary
    possible/impossible likely/unlikely probable/improbable able/unable capable/incapable
    always/sometimes usually/rarely often/rarely often/seldom frequently/rarely frequent/rare
    common/rare common/uncommon usual/unusual promote/demote hire/fire employ/dismiss
    employed/unemployed married/single married/unmarried marry/divorce marriage/divorce
    husband/wife father/mother son/daughter brother/sister uncle/aunt nephew/niece king/queen
    prince/princess masculine/feminine rent/buy attack/defend attack/defense offense/defense
    offensive/defensive war/peace friend/enemy ally/enemy ally/foe hero/villain victory/defeat
    win/lose winner/loser success/failure succeed/fail pass/fail strength/weakness
    advantage/disadvantage benefit/drawback benefit/harm pros/cons merit/demerit positive/negative
    optimist/pessimist optimistic/pessimistic optimism/pessimism bullish/bearish bull/bear
    love/hate like/dislike happy/sad happy/unhappy joy/sorrow glad/sorry laugh/cry smile/frown
    praise/criticize praise/blame reward/punish reward/punishment alive/dead live/die life/death
    birth/death born/died healthy/sick healthy/ill healthy/unhealthy health/disease rich/poor
    wealthy/poor wealth/poverty full/empty wet/dry clean/dirty light/dark bright/dark bright/dim
    day/night morning/evening dawn/dusk sunrise/sunset daytime/nighttime weekday/weekend
    north/south east/west northern/southern eastern/western left/right front/back forward/backward
    forwards/backwards ahead/behind head/tail horizontal/vertical row/column odd/even true/false
    right/wrong correct/incorrect correct/wrong accurate/inaccurate valid/invalid legal/illegal
    lawful/unlawful moral/immoral ethical/unethical honest/dishonest loyal/disloyal fair/unfair
    fair/foul polite/rude polite/impolite polite/uncivil civil/uncivil generous/stingy
    generous/selfish brave/cowardly courage/cowardice wise/foolish smart/stupid smart/dumb
    clever/stupid intelligent/stupid genius/idiot sane/insane beautiful/ugly pretty/ugly
    attractive/unattractive handsome/ugly interesting/boring exciting/boring fun/boring
    funny/serious serious/playful serious/frivolous formal/informal formal/casual good/bad
    good/evil good/poor best/worst excellent/terrible great/terrible nice/nasty benign/malignant
    beneficial/harmful helpful/harmful natural/artificial natural/synthetic natural/unnatural
    natural/supernatural organic/synthetic real/fake real/unreal real/imaginary genuine/fake
    authentic/fake original/fake original/copy actual/possible physical/virtual physical/digital
    raw/cooked fresh/stale fresh/rotten fresh/frozen solid/liquid liquid/gas acid/base
    acidic/alkaline acidic/basic sweet/sour sweet/bitter soft/loud smooth/rough loud/quiet
    noisy/quiet sharp/dull sharp/blunt sharp/flat tight/loose tighten/loosen fixed/variable
    constant/variable static/dynamic manual/automatic manually/automatically
    synchronous/asynchronous sync/async online/offline remote/local global/local urban/rural
    domestic/international domestic/foreign native/foreign local/foreign national/international
    permanent/temporary permanent/temporarily short-term/long-term busy/idle busy/free busy/quiet
    available/unavailable occupied/vacant asleep/awake sleep/wake remember/forget find/lose
    found/lost join/leave stay/leave stay/left continue/stop continue/cancel resume/pause
    play/pause start/pause subscribe/cancel attract/repel acid/alkali vowel/consonant
    singular/plural active/passive active/inactive transitive/intransitive voiced/voiceless
    voiced/unvoiced voiced/hard fast/slow quick/slow rapid/slow speed_up/slow_down quickly/slowly
    fast/slowly near/far close/far nearby/distant closer/further same/different same/other
    similar/different alike/different identical/different equal/unequal like/unlike like/different
    covert/overt covert/open hidden/open secret/public certain/uncertain sure/unsure sure/uncertain
    known/unknown familiar/unfamiliar clear/unclear clear/vague clear/opaque transparent/opaque
    humid/dry sunny/rainy calm/stormy calm/nervous calm/anxious relaxed/tense relaxed/stressed
    maximum/minimal uppercase/lowercase encourage/discourage approve/disapprove interesting/dull
    inhale/exhale implicit/explicit explicitly/implicitly innocent/guilty lazy/diligent
    lazy/hardworking cause/prevent obey/disobey maximal/minimal comedy/tragedy heaven/hell
    angel/devil god/devil mature/immature strict/lenient strict/loose sufficient/insufficient
    enough/insufficient adequate/inadequate reliable/unreliable stable/unstable stable/volatile
    relevant/irrelevant significant/insignificant important/unimportant crucial/noncrucial
    typical/atypical symmetric/asymmetric moral/amoral political/apolitical breathing/breathless
    active/dormant deaf/hearing important/trivial fertile/infertile fertile/barren
    primary/secondary
""")

#: Prefixes that make an antonym when the rest is a word on the other side ("unsafe"/"safe").
ANTONYM_PREFIXES = ("un", "in", "im", "il", "ir", "dis", "non", "de", "anti", "mis", "ab",
                    "counter", "dys", "mal")

#: Words that look like prefix antonyms but are not ("invaluable" is not "not valuable").
FALSE_PREFIX_ANTONYMS = _words("""
    invaluable inflammable unravel disannul inhabit infamous intense index inside into income
    input install invest insure incite increase impress imply import improve impose impact
    describe design desire detail determine develop depend deliver delete demand defend
    define degree device decide display dispose distance discuss discover dismiss
    disease dismay disguise dispatch dispute distribute district disturb ensure
    along about above across again against ago alone alive aside away awake aware amount
    apart around arise avoid await
    mission mislead
    uninstall
""")

#: Words that carry a negation without a negation cue: when one side has one more negation cue and
#: the other has one more of these, the two cancel ("won't fit" = "too large to fit", "without the
#: column" = "omitting the column").
IMPLICIT_NEGATORS = _words("""
    avoid avoids avoided avoiding prevent prevents prevented preventing omit omits omitted omitting
    lack lacks lacked lacking absence absent missing fail fails failed failing exclude excludes
    excluded excluding except unless too stop stops stopped stopping refuse refuses refused
    ignore ignores ignored ignoring skip skips skipped skipping instead unable
""")

# --------------------------------------------------------------------------------------------
# Numbers, dates, times, units

NUMBER_WORDS = {
    "zero": 0, "nil": 0, "one": 1, "two": 2, "three": 3, "four": 4, "five": 5, "six": 6,
    "seven": 7, "eight": 8, "nine": 9, "ten": 10, "eleven": 11, "twelve": 12, "thirteen": 13,
    "fourteen": 14, "fifteen": 15, "sixteen": 16, "seventeen": 17, "eighteen": 18,
    "nineteen": 19, "twenty": 20, "thirty": 30, "forty": 40, "fifty": 50, "sixty": 60,
    "seventy": 70, "eighty": 80, "ninety": 90, "dozen": 12, "couple": 2, "pair": 2,
    "half": 0.5, "quarter": 0.25, "twice": 2, "double": 2, "triple": 3, "thrice": 3,
    "single": 1, "once": 1,
}
NUMBER_SCALES = {"hundred": 100, "thousand": 1_000, "million": 1_000_000,
                 "billion": 1_000_000_000, "trillion": 1_000_000_000_000,
                 "k": 1_000, "m": 1_000_000, "mn": 1_000_000, "bn": 1_000_000_000,
                 "lakh": 100_000, "crore": 10_000_000}
ORDINAL_WORDS = {
    "first": 1, "second": 2, "third": 3, "fourth": 4, "fifth": 5, "sixth": 6, "seventh": 7,
    "eighth": 8, "ninth": 9, "tenth": 10, "eleventh": 11, "twelfth": 12, "thirteenth": 13,
    "fifteenth": 15, "twentieth": 20, "thirtieth": 30, "hundredth": 100, "thousandth": 1000,
}
#: "one" after these is a pronoun ("which one"), not a number.
ONE_PRONOUN_BEFORE = _words("which this that the each every any no some another other no")
#: An article on the other side can stand for "one"/"single" ("one item" ~ "an item").
ONE_ARTICLES = _words("a an single one")

MONTHS = {
    "january": 1, "jan": 1, "february": 2, "feb": 2, "march": 3, "mar": 3, "april": 4,
    "apr": 4, "may": 5, "june": 6, "jun": 6, "july": 7, "jul": 7, "august": 8, "aug": 8,
    "september": 9, "sep": 9, "sept": 9, "october": 10, "oct": 10, "november": 11, "nov": 11,
    "december": 12, "dec": 12,
}
#: Month abbreviations or names that are also common words: only dates when capitalised or
#: next to a number.
AMBIGUOUS_MONTHS = _words("may mar jan jun jul aug sep sept oct nov dec march")
WEEKDAYS = {
    "monday": "mon", "mon": "mon", "tuesday": "tue", "tue": "tue", "tues": "tue",
    "wednesday": "wed", "wed": "wed", "thursday": "thu", "thu": "thu", "thurs": "thu",
    "friday": "fri", "fri": "fri", "saturday": "sat", "sat": "sat", "sunday": "sun",
    "sun": "sun",
}
AMBIGUOUS_WEEKDAYS = _words("mon wed thu fri sat sun")
#: Calendar points: a change of any of these is a date change.
DATE_WORDS = {
    "today": "today", "tonight": "tonight", "tomorrow": "tomorrow", "yesterday": "yesterday",
    "now": "now", "currently": "now", "weekend": "weekend", "weekday": "weekday",
    "weekdays": "weekday", "weekends": "weekend", "morning": "morning",
    "afternoon": "afternoon", "evening": "evening", "midnight": "midnight", "noon": "noon",
    "midday": "noon", "overnight": "overnight", "night": "night", "nighttime": "night",
    "spring": "spring", "summer": "summer", "autumn": "autumn", "winter": "winter",
    "daily": "day", "weekly": "week", "monthly": "month", "yearly": "year", "annual": "year",
    "annually": "year", "hourly": "hour", "quarterly": "quarter", "biweekly": "2week",
}
#: Units of time: "last week" vs "last month" is a change of period.
TIME_UNITS = {
    "second": "second", "sec": "second", "secs": "second", "minute": "minute", "min": "minute",
    "mins": "minute", "hour": "hour", "hr": "hour", "hrs": "hour", "day": "day",
    "week": "week", "wk": "week", "fortnight": "2week", "month": "month", "mo": "month",
    "quarter": "quarter", "year": "year", "yr": "year", "decade": "decade",
    "century": "century", "millennium": "millennium",
}
#: Words that anchor a period in time: "last/this/next/past week".
PERIOD_ANCHORS = _words("last this next past previous coming current every per each")

#: Units of measure and currencies, each mapped to a canonical name.
UNITS = {
    "mile": "mile", "mi": "mile", "km": "km", "kilometer": "km", "kilometre": "km",
    "meter": "m", "metre": "m", "cm": "cm", "centimeter": "cm", "centimetre": "cm",
    "mm": "mm", "millimeter": "mm", "millimetre": "mm", "foot": "ft", "feet": "ft", "ft": "ft",
    "inch": "in", "inches": "in", "yard": "yd", "yd": "yd",
    "kg": "kg", "kilogram": "kg", "kilo": "kg", "gram": "g", "g": "g", "mg": "mg",
    "milligram": "mg", "pound": "lb", "lb": "lb", "lbs": "lb", "ounce": "oz", "oz": "oz",
    "ton": "ton", "tonne": "ton", "stone": "stone",
    "liter": "l", "litre": "l", "l": "l", "ml": "ml", "milliliter": "ml", "millilitre": "ml",
    "gallon": "gal", "gal": "gal", "pint": "pint", "cup": "cup", "tablespoon": "tbsp",
    "tbsp": "tbsp", "teaspoon": "tsp", "tsp": "tsp",
    "celsius": "c", "centigrade": "c", "fahrenheit": "f", "kelvin": "k",
    "mph": "mph", "kph": "kmh", "kmh": "kmh",
    "byte": "b", "kb": "kb", "kilobyte": "kb", "mb": "mb", "megabyte": "mb", "gb": "gb",
    "gigabyte": "gb", "tb": "tb", "terabyte": "tb", "mbps": "mbps", "gbps": "gbps",
    "kbps": "kbps", "hz": "hz", "khz": "khz", "mhz": "mhz", "ghz": "ghz",
    "watt": "w", "w": "w", "kw": "kw", "kilowatt": "kw", "kwh": "kwh", "volt": "v",
    "amp": "a", "mah": "mah", "calorie": "kcal", "kcal": "kcal", "cal": "kcal",
    "percent": "%", "percentage": "%", "%": "%", "pct": "%",
    "dollar": "usd", "usd": "usd", "$": "usd", "buck": "usd", "euro": "eur", "eur": "eur",
    "€": "eur", "£": "gbp", "gbp": "gbp", "quid": "gbp", "yen": "jpy", "jpy": "jpy",
    "¥": "jpy", "rupee": "inr", "inr": "inr", "rs": "inr", "₹": "inr", "yuan": "cny",
    "cny": "cny", "rmb": "cny", "cent": "cent", "penny": "cent", "pence": "cent",
    "bitcoin": "btc", "btc": "btc", "cad": "cad", "aud": "aud", "chf": "chf",
}
#: Units that are also ordinary words: only units right after a number.
AMBIGUOUS_UNITS = _words("""
    m g l w a in cup stone ton pound cal mi mo yd ft oz pint amp volt cent penny buck rs min
    sec k f c v
""")

# --------------------------------------------------------------------------------------------
# Scope: audience, possessor, quantity

#: Groups of audience / subject nouns; members of one group are interchangeable, words of
#: different groups (or a group on one side only) change who the answer is for.
AUDIENCE_GROUPS = _groups("""
    child children kid kids toddler toddlers minor minors
    baby babies infant infants newborn newborns
    teen teens teenager teenagers adolescent adolescents youth
    adult adults grownup grownups
    senior seniors elderly pensioner pensioners retiree retirees
    man men guy guys gentleman gentlemen
    woman women lady ladies
    boy boys
    girl girls
    male males
    female females
    pregnant pregnancy
    dog dogs puppy puppies
    cat cats kitten kittens
    horse horses
    bird birds parrot
    rabbit rabbits
    fish
    pet pets
    student students pupil pupils
    teacher teachers tutor tutors
    parent parents mom mum mother father dad
    son sons
    daughter daughters
    brother brothers
    sister sisters
    grandparent grandparents grandmother grandfather grandma grandpa
    grandchild grandchildren grandson granddaughter
    employee employees staff worker workers
    employer employers
    manager managers boss
    customer customers client clients
    guest guests
    member members subscriber subscribers
    admin admins administrator administrators
    beginner beginners novice novices newbie newbies
    expert experts professional professionals
    individual individuals
    company companies business businesses corporation corporations firm firms
    nonprofit nonprofits charity charities
    resident residents citizen citizens local locals
    visitor visitors tourist tourists
    foreigner foreigners immigrant immigrants
    patient patients
    doctor doctors physician physicians
    landlord landlords
    tenant tenants renter renters
    owner owners
    partner partners spouse husband wife
    friend friends
    team
    family
    developer developers
    contractor contractors freelancer freelancers
    veteran veterans
    smoker smokers
    diabetic diabetics
    vegetarian vegetarians vegan vegans
""")

#: Possessors, by person. "I/my" and "you/your" are interchangeable (people write "your" for a
#: generic reader); first or second person against third person ("my" vs "his", "own" vs
#: "another") is a change of whose thing it is.
POSSESSOR_SELF = _words("my mine myself our ours ourselves your yours yourself yourselves own")
POSSESSOR_OTHER = _words("""
    his her hers their theirs another someone somebody else other others someones
    somebodys anothers
""")

#: Quantifier groups: universal, single, dual, partial. A side with one group against a side with
#: a conflicting one (universal vs single or partial, dual vs single) changes how much is asked
#: about ("one item" vs "the whole order").
QUANT_UNIVERSAL = _words("all every whole entire everything entirety everyone everybody")
QUANT_SINGLE = _words("one single")
QUANT_DUAL = _words("both")
QUANT_PARTIAL = _words("part partial portion half")
QUANT_CONFLICTS = (("u", "s"), ("u", "p"), ("d", "s"))

#: Words that narrow or widen a set ("only", "except", "outside"): one on one side only changes
#: the scope.
SCOPE_WORDS = _words("except excluding outside")

#: Particles that flip a phrasal verb ("log in"/"log out", "turn on"/"turn off") when they follow
#: the same word on both sides; alone they are too common to count as antonyms.
PARTICLE_PAIRS = _pairs("in/out on/off up/down over/under")

#: Words before a number word that make it an ordinal of a thing ("the first chapter"), not an
#: adverb ("check the docs first").
DETERMINERS = _words("the my your our his her their its this that these those every each a an")

# --------------------------------------------------------------------------------------------
# Stop words and politeness (never content words)

STOP_WORDS = _words("""
    a an the and or but if then so as of at by for with to from in on into onto upon about
    over under up down out off through during before after above below between among across
    along around against toward towards via per than too very really quite rather just also
    even still yet already again ever much many more most less least some any such own same
    other another each every all both either neither few several this that these those there
    here where when why how what which who whom whose whoever whatever whichever
    i me my mine myself we us our ours ourselves you your yours yourself yourselves he him his
    himself she her hers herself it its itself they them their theirs themselves one ones
    be am is are was were been being have has had having do does did doing done
    can could may might must shall should will would ought need
    get gets got getting let lets make makes made
    is isnt not no
    there's it's that's
    thing things something anything everything nothing someone anyone everyone
    way ways kind sort type lot lots bit
    like well okay ok
    s t d ll re ve m
    etc eg ie vs versus
    tell know explain show give want wondering wonder help
    actually basically exactly simply generally usually typically
    possible possibly able
    mean means meaning
    now currently
""")
POLITENESS = _words("""
    please pls plz kindly thanks thank thx ty cheers hi hello hey dear sir madam greetings
    appreciate appreciated grateful sorry excuse regards
""")
#: Question words that change what is asked; "what/which/how" are interchangeable, the others
#: are not interchangeable with each other.
WH_DISTINCT = _words("when where who why")


# --------------------------------------------------------------------------------------------
# Added detail: a qualifier on one side only narrows what is asked ("...from abroad")

#: Words that open a qualifying phrase: "cancel my subscription" vs "... from abroad", "... for
#: beginners", "... during a layoff", "... using Excel".
DETAIL_PREPOSITIONS = _words("""
    in for from with without during at on under over within via using through throughout
    inside near among while whilst until till amid amidst across against per
""")

#: Words that restrict what is asked on their own wherever they stand, when the other side has no
#: counterpart: price and access (cheap, free), level (beginner, advanced), place (abroad, local,
#: online), ownership and status (private, refurbished, official), make (homemade, electric).
DETAIL_QUALIFIERS = _words("""
    cheap cheapest free budget premium discounted beginner beginners introductory intermediate
    advanced latest newest secondhand refurbished online offline abroad overseas foreign
    international domestic local locally nearby remote remotely private public personal
    commercial corporate official unofficial homemade handmade organic portable wireless wired
    electric electronic manual automatic temporary permanent permanently legal legally illegal
    illegally professional amateur
""")

#: Words that never make a detail and never count as a rewording: what a question asks for in
#: general ("the best way to", "some tips on", "the steps to"), hedges and intensifiers, asking
#: and opinion ("tell me", "do you think"), generic people ("someone").
DETAIL_NEUTRAL = _words("""
    way ways method methods step steps procedure procedures tip tips advice guide guides guidance
    idea ideas thing things stuff question questions answer answers info information detail
    details instruction instructions tutorial tutorials example examples reason reasons option
    options suggestion suggestions recommendation recommendations approach strategy strategies
    technique techniques solution solutions list overview summary explanation meaning yes
    really truly ever generally usually typically normally actually exact actual real certain
    sure possible able likely best better good ideal ideally proper properly correct correctly
    right effective effectively efficient efficiently ok okay fine
    person people someone somebody anyone anybody everyone everybody
    think believe feel guess suppose wonder wondering curious opinion view
    tell know explain describe show help recommend suggest advise please mean want wants like
    would need needs needed
""")

#: Light words: never a detail themselves, but one left unmatched on a side means that side was
#: reworded, so the other side's extra words may be its rewording, not an addition ("how to
#: *handle* a dataset" vs "how to *process* a dataset", "in numerical *sequence*" vs "in
#: numerical *order*").
DETAIL_LIGHT = _words("""
    go going goes went try trying tried use using used usage utilization utilisation do doing
    done get getting make making find finding learn start begin proceed manage process run runs
    works happen happens exist exists existing available easy easiest easily simple simplest
    simply quick quickly fast fastest order terms regard regards respect relation general
    particular addition fact case basis manner practice time times once size number amount
    total place version name
""")

# --------------------------------------------------------------------------------------------
# Synonyms (for the content-word check only: a word replaced by a listed synonym is no change)

SYNONYM_GROUPS = _groups("""
    buy purchase acquire
    get obtain receive acquire gain fetch retrieve
    big large huge enormous massive sizable
    small little tiny compact
    fast quick rapid speedy swift quickly rapidly swiftly speedily
    begin start commence launch initiate
    end finish complete conclude
    stop halt cease quit discontinue
    show display present demonstrate exhibit reveal
    make create build generate produce construct develop craft
    use utilize utilise employ apply leverage usage
    need require necessary essential needed required must
    want wish desire
    help assist aid support facilitate
    fix repair resolve solve troubleshoot
    error issue problem bug fault glitch trouble
    way method approach technique manner means procedure process
    good great nice excellent fine decent awesome top
    bad poor terrible awful
    phone mobile smartphone cellphone
    car vehicle automobile auto
    money cash funds fund
    job work career employment occupation profession
    choose select pick opt
    change modify alter edit adjust update tweak
    remove delete erase eliminate drop
    idea notion concept
    answer reply response respond
    question query inquiry enquiry
    find locate discover
    look search seek browse
    learn study
    understand comprehend grasp
    important significant crucial key vital essential major
    difference differ distinction
    advice tips tip suggestions recommendations guidance pointers
    recommend suggest advise
    provide offer supply furnish give deliver yield return output produce
    enable allow let permit
    task job chore assignment
    tool utility instrument
    library package module framework toolkit
    option parameter setting argument flag
    function method routine procedure
    data information info
    document doc documentation docs
    picture image photo photograph pic
    movie film
    site website webpage
    app application program software
    computer pc laptop
    price cost fee charge
    cheap inexpensive affordable
    expensive costly pricey
    easy simple straightforward effortless
    hard difficult tough challenging
    happy glad pleased joyful
    sad unhappy upset
    angry mad furious
    ill sick unwell
    doctor physician
    lawyer attorney
    kid child
    mom mother mum
    dad father
    reason cause
    benefit advantage pro upside
    drawback disadvantage con downside
    effect impact affect influence consequence
    increase raise boost grow enlarge
    decrease reduce lower lessen diminish
    rule regulation law
    allowed permitted
    mistake error
    travel trip journey
    nation country
    town city
    correct right accurate exact precise
    wrong incorrect mistaken inaccurate
    fridge refrigerator
    tv television
    email mail
    persons people person individuals folks
    manage handle administer
    store save keep
    contact reach
    refund reimbursement repayment
    cancel terminate
    explain describe detail outline clarify
    meaning definition
    speak talk say
    combine merge join concatenate unite
    broken damaged faulty defective
    check verify
    send transmit
    aim goal purpose objective intent intention
    common usual typical normal standard ordinary regular
    rare unusual uncommon atypical
    suitable appropriate proper fitting
    instance example
    various different several diverse variety varied multiple many numerous
    capability ability capacity
    enhance improve better
    typically usually generally commonly
    select retrieve fetch extract
    iterate cycle loop traverse
    define specify declare designate indicate set
    cast convert transform turn translate
    load read import open
    corresponding related associated matching relevant
    special specific particular certain
    type kind sort variety class category form
    name title
    number amount count quantity total
    deprecate deprecated discontinue discontinued obsolete outdated
    location path place position
    perform execute run carry conduct
    contain include comprise encompass hold
    split division partition divide
    access reach
    store keep save hold retain
    big large
    sure certain confident
    likely probable
    same identical alike equal
    logical coherent rational reasonable sensible
    safe secure
    danger dangerous risk risky hazard hazardous peril
    familiar known usual
    strange weird odd unusual peculiar unfamiliar
    bright smart intelligent clever brilliant
    dull boring tedious
    true truthful honest genuine real
    false untrue fake
    active energetic lively
    quiet silent calm
    rich wealthy
    poor broke
    clean tidy
    dirty filthy messy
    old aged elderly
    new fresh novel recent
    strong powerful
    weak feeble
    tired exhausted
    rude impolite
    polite courteous civil
    evil wicked bad
    kind nice friendly
    beautiful pretty lovely attractive gorgeous
    ugly unattractive hideous
    fat overweight obese
    thin slim skinny slender
    afraid scared frightened
    brave courageous bold
    lucky fortunate
    unlucky unfortunate
    possible feasible doable
    impossible infeasible
    complex complicated intricate
    clear obvious evident
    unclear vague ambiguous uncertain
    deal matter
    shortcut hotkey
    error exception
    repository repo
    directory folder
    configuration config settings setup
    install setup
    begin commence
    fix patch
    delete deletion
    permission access rights
    purchase order
    buy shop
    exit quit leave
    online internet web
    website site
    message text
    picture pic
    huge massive
    tiny minute
    approximately roughly about around nearly
    also additionally furthermore moreover
    mainly mostly primarily chiefly
    quickly fast rapidly
    immediately instantly
    frequently often regularly
    fix mend
    handle deal
    verify confirm validate
    method technique
    employ hire
    assess evaluate measure
    share distribute
    upload post
    constructor builder
    record row entry
    segment chunk piece part portion
    characteristic attribute property feature trait
    illustrate depict portray show display demonstrate
    elaborate clarify explain describe outline detail
    harness leverage utilize employ apply use
    establish form create construct produce generate
    procure acquire obtain gain secure
    grant give offer furnish supply provide deliver
    output yield return produce
    empower enable allow permit
    facilitate support assist help aid
    necessitate require demand need
    detect identify spot discover locate find
    elect opt choose select pick
    initiate commence begin start
    terminate conclude finish complete end
    validate verify confirm ensure check examine inspect
    incorporate include contain comprise encompass hold
    persist preserve retain store save keep cache
    ingest load read import
    separate partition segment divide split
    unify integrate consolidate combine merge join concatenate unite
    discard strip eliminate erase remove delete
    append attach insert add
    invoke call execute run perform conduct
    configure set specify define declare designate indicate determine
    traverse loop cycle iterate
    optimize optimise improve enhance boost
    minimize minimise shrink diminish reduce decrease
    denote signify represent indicate mean
    calculate compute determine evaluate estimate measure assess
    publish distribute share
    characterize characterise portray describe
    regard consider view
    accommodate handle support accept
    mention note state say indicate
    notify inform tell
    inquire enquire query ask request
    attempt try
    address resolve solve fix repair correct troubleshoot
    deploy install setup configure
    trigger cause produce
    affect impact influence
    maintain preserve retain keep
    comply adhere follow obey
    relate associate link connect tie
    arrange organize organise sort order rank
    sift screen filter
    randomize randomise shuffle mix
    forecast predict estimate
    routine procedure function method
    argument parameter option setting flag
    toolkit framework library package module
    functionality capability ability feature
    variety kind sort type class category
    illustration instance example sample
    glitch fault bug error issue problem
    directory folder
    dimension size length
    quantity amount count number total
    label title name
    walkthrough tutorial guide instructions
    details information info data
    objective aim goal purpose intent intention
    outcome result output
    format layout structure schema
    field attribute column
    record row entry
    element item entry member object
    particular specific certain given designated specified indicated
    corresponding related associated relevant matching
    substantial sizable large big huge massive
    minor little tiny small compact
    swift speedy rapid quick fast
    effortless simple straightforward easy
    challenging tough difficult hard
    principal chief central primary main key
    entire whole complete full total
    numerous multiple several various many
    mandatory required necessary essential needed compulsory
    capable able
    feasible possible
    advantageous beneficial valuable useful helpful
    comparable similar alike
    distinct diverse different various
    preceding former prior previous earlier
    subsequent following next upcoming
    existing present current
    preset default standard
    supplementary additional extra further
    fitting suitable appropriate proper
    distinctive unique distinct
    obtainable accessible available
    furthermore moreover additionally also
    designed intended meant
    primarily mainly mostly chiefly largely
    precisely exactly accurately
    automatically automatic
    typically usually generally commonly normally
    latest newest recent
    author write writer
""")

#: British and American spellings (beyond -ise/-ize and -our/-or, which are handled by rule).
SPELLING_VARIANTS = {
    "centre": "center", "theatre": "theater", "metre": "meter", "litre": "liter",
    "fibre": "fiber", "cheque": "check", "tyre": "tire", "grey": "gray", "programme": "program",
    "catalogue": "catalog", "dialogue": "dialog", "analogue": "analog", "licence": "license",
    "defence": "defense", "offence": "offense", "practise": "practice", "aluminium": "aluminum",
    "mum": "mom", "travelling": "traveling", "travelled": "traveled", "cancelled": "canceled",
    "cancelling": "canceling", "modelling": "modeling", "labelled": "labeled",
    "jewellery": "jewelry", "plough": "plow", "pyjamas": "pajamas", "sceptical": "skeptical",
    "enrol": "enroll", "fulfil": "fulfill", "mould": "mold", "ageing": "aging",
    "favour": "favor", "colour": "color", "behaviour": "behavior", "honour": "honor",
    "neighbour": "neighbor", "flavour": "flavor", "humour": "humor", "labour": "labor",
    "harbour": "harbor", "rumour": "rumor", "vapour": "vapor", "armour": "armor",
    "analyse": "analyze", "paralyse": "paralyze", "e-mail": "email", "okay": "ok",
}

#: Irregular forms -> base form, used for matching and antonym lookup.
IRREGULAR = {
    "better": "good", "best": "good", "worse": "bad", "worst": "bad",
    "children": "child", "men": "man", "women": "woman", "people": "person", "feet": "foot",
    "teeth": "tooth", "mice": "mouse", "geese": "goose", "lives": "life", "wives": "wife",
    "knives": "knife", "leaves": "leaf", "halves": "half", "shelves": "shelf",
    "went": "go", "gone": "go", "bought": "buy", "sold": "sell", "brought": "bring",
    "took": "take", "taken": "take", "gave": "give", "given": "give", "got": "get",
    "gotten": "get", "made": "make", "said": "say", "found": "find", "lost": "lose",
    "won": "win", "ran": "run", "began": "begin", "begun": "begin", "chose": "choose",
    "chosen": "choose", "wrote": "write", "written": "write", "ate": "eat", "eaten": "eat",
    "drove": "drive", "driven": "drive", "knew": "know", "known": "know", "grew": "grow",
    "grown": "grow", "fell": "fall", "fallen": "fall", "rose": "rise", "risen": "rise",
    "felt": "feel", "kept": "keep", "slept": "sleep", "spent": "spend", "sent": "send",
    "built": "build", "held": "hold", "taught": "teach", "thought": "think",
    "caught": "catch", "fought": "fight", "sought": "seek", "met": "meet", "paid": "pay",
    "stood": "stand", "understood": "understand", "told": "tell", "heard": "hear",
    "meant": "mean", "broke": "break", "broken": "break", "spoke": "speak", "spoken": "speak",
    "woke": "wake", "woken": "wake", "froze": "freeze", "frozen": "freeze", "hid": "hide",
    "hidden": "hide", "forgot": "forget", "forgotten": "forget", "wore": "wear",
    "worn": "wear", "tore": "tear", "torn": "tear", "died": "die", "dying": "die",
    "lying": "lie", "lay": "lie", "shown": "show", "seen": "see", "saw": "see",
    "did": "do", "done": "do", "does": "do", "has": "have", "had": "have",
    "is": "be", "are": "be", "was": "be", "were": "be", "been": "be", "am": "be",
    "data": "data", "media": "media", "criteria": "criterion", "phenomena": "phenomenon",
    "analyses": "analysis", "bases": "basis", "crises": "crisis", "theses": "thesis",
    "cons": "con", "pros": "pro", "news": "news", "series": "series", "species": "species",
    "less": "less", "unless": "unless", "across": "across", "always": "always",
    "various": "various", "famous": "famous", "previous": "previous", "serious": "serious",
    "dangerous": "dangerous", "this": "this", "its": "its", "his": "his", "thus": "thus",
    "plus": "plus", "bus": "bus", "gas": "gas", "yes": "yes", "us": "us",
    "early": "early", "only": "only", "daily": "daily", "weekly": "weekly",
    "monthly": "monthly", "yearly": "yearly", "hourly": "hourly", "family": "family",
    "reply": "reply", "apply": "apply", "supply": "supply", "july": "july", "italy": "italy",
    "fly": "fly", "ally": "ally", "rely": "rely", "ugly": "ugly", "likely": "likely",
    "unlikely": "unlikely", "lonely": "lonely", "lovely": "lovely", "friendly": "friendly",
    "silly": "silly", "holy": "holy", "assembly": "assembly", "anomaly": "anomaly",
    "butterfly": "butterfly", "belly": "belly", "jelly": "jelly", "bully": "bully",
    "interest": "interest", "forest": "forest", "request": "request", "honest": "honest",
    "modest": "modest", "harvest": "harvest", "suggest": "suggest", "digest": "digest",
    "protest": "protest", "contest": "contest", "manifest": "manifest", "arrest": "arrest",
    "invest": "invest", "chest": "chest", "guest": "guest", "quest": "quest",
    "priest": "priest", "latest": "late", "biggest": "big",
    "wasted": "waste", "need": "need", "speed": "speed", "feed": "feed", "seed": "seed",
    "bed": "bed", "red": "red", "shed": "shed", "wed": "wed", "hundred": "hundred",
    "indeed": "indeed", "proceed": "proceed", "succeed": "succeed", "exceed": "exceed",
    "agreed": "agree", "freed": "free", "used": "use", "based": "base",
    "offer": "offer", "order": "order", "answer": "answer", "power": "power",
    "water": "water", "paper": "paper", "number": "number", "other": "other",
    "after": "after", "over": "over", "under": "under", "ever": "ever", "never": "never",
    "either": "either", "neither": "neither", "whether": "whether", "rather": "rather",
    "together": "together", "user": "user", "computer": "computer", "remember": "remember",
    "member": "member", "consider": "consider", "register": "register", "enter": "enter",
    "center": "center", "matter": "matter", "letter": "letter", "filter": "filter",
    "printer": "printer", "server": "server", "partner": "partner", "layer": "layer",
    "player": "player", "folder": "folder", "chapter": "chapter", "summer": "summer",
    "winter": "winter", "river": "river", "silver": "silver", "super": "super",
    "upper": "upper", "lower": "low", "inner": "inner", "outer": "outer",
    "teacher": "teacher", "manager": "manager", "owner": "owner", "buyer": "buyer",
    "seller": "seller", "sender": "sender", "worker": "worker", "driver": "driver",
    "writer": "writer", "reader": "reader", "speaker": "speaker", "beginner": "beginner",
    "employer": "employer", "customer": "customer", "router": "router", "container": "container",
    "encoder": "encoder", "decoder": "decoder", "heater": "heater", "cooler": "cooler",
    "rather_": "rather", "further": "far", "farther": "far", "furthest": "far",
    "farthest": "far", "elder": "old", "eldest": "old",
    "more": "more", "most": "most", "fewer": "fewer", "fewest": "fewest", "least": "least",
}
