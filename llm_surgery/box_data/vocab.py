"""Words of the Box task: the object vocabularies and the template words.

`COMMON_OBJECTS` are the 100 frequent concrete nouns of the original task (Kim & Schuster 2023).
`RARE_OBJECTS` is our own list of 100 rare concrete nouns, disjoint from it, for the held-out-vocabulary test.
All objects are single lower-case alphabetic words, so whitespace splitting recovers them from the text.
"""

COMMON_OBJECTS: tuple[str, ...] = tuple(
    """
    book car paper letter game computer picture plant cup machine bill glass note stone fish drug television card
    document rock radio ball tea file newspaper branch train cash fig flower bag boat key painting phone drink
    engine bus coffee sheet plate magazine egg tape bottle block brain map crown ring leaf dress fan milk ticket
    shoe bone gift cross plane mirror coat wheel string ice rose boot hat suit creature bomb camera bread cake meat
    beer shirt cigarette jacket apple pipe guitar disk medicine knife cream clock chemical seed tie watch cheese
    bowl dish shell wire tissue pot brick bell
    """.split()
)

RARE_OBJECTS: tuple[str, ...] = tuple(
    """
    theremin otamatone biscotti astrolabe sextant metronome kazoo ocarina didgeridoo harpsichord zither sitar ukulele
    accordion bagpipe castanet tambourine xylophone glockenspiel harmonica gyroscope hourglass periscope stethoscope
    barometer thermos colander spatula ladle whisk trowel chisel awl gimlet sundial kaleidoscope monocle lorgnette
    snorkel harpoon trident scimitar cutlass rapier halberd crossbow boomerang frisbee pinwheel abacus quill inkwell
    parchment papyrus tiara brooch locket amulet talisman scarab cameo fez sombrero beret bonnet kimono sarong poncho
    cravat cummerbund moccasin espadrille samovar tureen decanter carafe chalice goblet tankard flagon croissant
    baguette pretzel macaron meringue strudel brioche quiche kumquat lychee rambutan durian persimmon pomegranate
    artichoke kohlrabi truffle geode fossil nautilus
    """.split()
)

# Every non-object word and punctuation mark the generator writes (see generate.py's templates).
TEMPLATE_WORDS: tuple[str, ...] = (
    "Box", "contains", "the", "and", "is", "empty", "Move", "from", "to", "Remove", "Put", "into", ",", ".",
)
