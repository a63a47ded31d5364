"""The call envelope: one budget of calls and tokens shared by every worker (``envelope``), its
state and replies (``state``), its refusals (``refusals``), and the guards that spend it
(``guards``).
"""
