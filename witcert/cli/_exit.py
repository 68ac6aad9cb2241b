"""The ``witcert`` command's exit statuses: 1 is reserved for a soundness violation.

===  ==========================================================================================
0    done
1    a soundness violation was found: a cell's true TV above its meter
2    a usage error: a bad argument, a missing extra, a context too short (before any work)
3    the run failed after its arguments were accepted: the model would not load, an output could
     not be written, out of memory (one line on stderr, no traceback)
4    an internal error: a bug in WitCert (the traceback is printed)
130  interrupted (Ctrl-C)
141  the output pipe was closed (``witcert schemes | head -1``)
===  ==========================================================================================
"""
EXIT_OK = 0
EXIT_VIOLATION = 1
EXIT_USAGE = 2
EXIT_FAILURE = 3
EXIT_INTERNAL = 4
EXIT_INTERRUPTED = 128 + 2  # SIGINT, as a shell reports Ctrl-C
EXIT_SIGPIPE = 128 + 13  # what a tool killed by SIGPIPE reports
