"""The release this code is: setup.cfg packages it, /metrics reports it, each worker logs it.

Read from the code rather than the installed metadata, so a worker reports the release it
imported: an editable checkout's metadata says what was installed, not what was checked out.
"""

VERSION = "1.2.0.dev0"
