"""Sources a collection follows and keeps in sync: a Git repository, a website, a server folder.

- ``store.py``: the sources of a collection and, per file, the content hash ingested and the
  documents it became (``<collection>/sources.sqlite3``);
- ``checks.py``: what a new source must be (URL forms, allowed roots, the address guard);
- ``git.py``, ``web.py``, ``folder.py``: fetching a source's files to local disk;
- ``globs.py``: the path globs that pick files;
- ``sync.py``: one sync, an io job of kind ``sync``: only changed files parsed and embedded;
- ``schedule.py``: starting syncs on demand and from Celery beat, one at a time per source.

The routes are in ``services/retrieval/api/sources.py``; docs/retrieval.md ("Sources") says how
to use them.
"""
