"""The call envelope: one budget of calls and tokens shared by every worker, and the guards that
spend it.
"""
