"""Reference implementations and shared helpers for the Training at Speed course.

One module per topic; a chapter's notebook imports what it needs, starting with ``env``.
"""
