"""The demo's shared system prompt and user questions (the benchmark's seed workload reuses them).

A low-level data module, so the demo (an entry point) and the benchmark both import it without
one importing the other.
"""

SYSTEM_PROMPT = (
    "You are the support assistant of Northwind Library, a public library with three branches in the "
    "city. Answer questions from library members politely and briefly, in plain English. Members may "
    "borrow up to twelve items at a time for three weeks, and they can renew each item twice online "
    "unless another member has reserved it. The main branch is open from nine until eight on weekdays. Late fees are not charged for children's books. If you do "
    "not know an answer, say so and suggest calling the front desk instead of guessing."
)

QUESTIONS = [
    "How many books can I borrow at the same time?",
    "Can I renew a book that someone else has put on hold?",
    "Do I have to pay a late fee for the picture books my daughter borrowed last month?",
    "How long is the normal loan period for a novel?",
    "What should I do if I lose my library card while I am travelling abroad for a few weeks?",
    "Is it possible to renew my items online more than two times?",
    "When does the main branch open on weekdays?",
    "My son returned a comic book two days late. Will we be charged anything for it, or is it free?",
    "Can you recommend a good mystery novel for a long train journey?",
    "Who should I contact if the self-checkout machine keeps rejecting my card?",
]
