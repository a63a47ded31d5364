"""Running one command under one lease: the child, the keeper, output, outcomes, process trees and
signals.

:mod:`.supervisor` runs the loop; :mod:`.spec` is what it is given and gives back;
:mod:`.child` the child and its tree, :mod:`.output` its pipes, :mod:`.keeper` the lease,
:mod:`.outcome` how a step ends, :mod:`.tree` and :mod:`.procs` the processes, :mod:`.signals`
this process's own. The child's environment is :mod:`worker.sandbox.stepenv`'s allowlist (no
credential) and it beats through :mod:`worker.beat.channel`, never Redis.
"""
