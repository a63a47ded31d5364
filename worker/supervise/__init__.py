"""Running one command under one lease: the child, the keeper, output, outcomes, process trees and
signals.
"""
