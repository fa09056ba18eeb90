#!/usr/bin/env python3
"""Writes jobs/data/tickets.parquet, the sample input of jobs/summarise.toml (`prompt`), jobs/embed.toml (`text`)
and jobs/seq2seq.toml (`t5_prompt`) (committed; rerun to change it).

Needs pyarrow (pip install pyarrow); nightshift itself does not.
"""
import pathlib

import pyarrow as pa
import pyarrow.parquet as pq

TICKETS = [
    "The printer on the third floor jams every time someone prints more than ten pages. We have cleared it twice today and the queue is now stuck with forty jobs.",
    "I was charged twice for my March subscription. The second charge appeared on April 2nd. Please refund the duplicate payment to my card.",
    "After the latest update the mobile app crashes as soon as I open the settings screen. I am on Android 14 and reinstalling did not help.",
    "Our team cannot access the shared drive since this morning. The error says the network path was not found. Other websites work fine.",
    "I would like to change the delivery address for order 48213 to my office: 12 King Street, Leeds. The parcel has not shipped yet.",
    "The password reset email never arrives. I checked the spam folder and tried three times over the last hour.",
    "The conference room projector shows no signal when we connect a laptop over HDMI. It worked last week.",
    "Can you extend my free trial by one week? I was travelling and could not test the reporting features.",
    "The invoice PDF for February is blank when I download it from the billing page. The January one opens fine.",
    "Two of our new hires have not received their laptops. They start on Monday and need accounts for email and chat.",
    "The website checkout page is very slow today. Payments take more than a minute and some customers gave up.",
    "Please cancel my subscription at the end of the current billing period and confirm by email.",
]

out = pathlib.Path(__file__).resolve().parent.parent / "jobs" / "data" / "tickets.parquet"
table = pa.table({
    "id": [f"ticket-{i + 1:03d}" for i in range(len(TICKETS))],
    # SmolLM2-135M follows an instruction after the text better than before it.
    "prompt": [f"Support ticket:\n{t}\n\nSummarise the ticket above in one short sentence." for t in TICKETS],
    # The ticket alone, for embedding jobs.
    "text": TICKETS,
    # T5's task prefix and the ticket, for seq2seq jobs.
    "t5_prompt": [f"summarize: {t}" for t in TICKETS],
})
pq.write_table(table, out, compression="snappy")
print(f"wrote {out} ({table.num_rows} rows)")
