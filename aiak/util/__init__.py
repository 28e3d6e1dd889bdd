"""What every layer of aiak may use and nothing of aiak's: warnings, nested outputs, text, hardware facts,
versions, thread shutdown, process groups, the marks aiak keeps on user objects. Modules here import no other part
of aiak."""
