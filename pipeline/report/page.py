"""The HTML page: escaping, JSON embedding, and the page skeleton with its small inline script (ours, no libraries).

Everything a user wrote (memory text, questions, options, ids) reaches the page either through `html.escape` in
server-rendered tables or as JSON data that the script puts into the DOM with `textContent`, never as markup. JSON
inside <script> is escaped against `</script>` breakout (every <, > and & becomes a \\u escape).
"""

from __future__ import annotations

import html
import json
import math

from pipeline.core.text import no_bidi

CSS = """
body{font:14px/1.45 system-ui,-apple-system,'Segoe UI',sans-serif;margin:0;color:#222;background:#fafafa}
header{background:#1f3b57;color:#fff;padding:14px 24px}header h1{margin:0;font-size:20px}
header p{margin:4px 0 0;color:#cfd8e3;font-size:12px}
main{padding:8px 24px 40px;max-width:1400px}
section{background:#fff;border:1px solid #e3e3e3;border-radius:6px;padding:12px 16px;margin:14px 0}
h2{font-size:16px;margin:0 0 8px}h3{font-size:14px;margin:12px 0 6px}
table{border-collapse:collapse;font-size:13px}th,td{padding:3px 8px;border-bottom:1px solid #eee;text-align:left;vertical-align:top}
th{background:#f3f5f7;position:sticky;top:0}td:first-child,#qtable td:nth-child(2),td.n{white-space:nowrap}td.n,th.n{text-align:right}
#qtable th{cursor:pointer;user-select:none}#qtable tbody tr{cursor:pointer}#qtable tbody tr:hover{background:#eef4fb}
#qtable tbody tr.sel{background:#dbe9f7}
.wrap{max-height:420px;overflow:auto;border:1px solid #eee}
.st-recovered{color:#1e8449;font-weight:600}.st-wrong{color:#c0392b;font-weight:600}.st-correct{color:#555}
.harm{background:#fdecea}.chosen{background:#e8f6ec;font-weight:600}
.muted{color:#777;font-size:12px}.mono{font-family:ui-monospace,monospace;font-size:12px}
input[type=search]{width:320px;padding:4px 8px;font-size:13px}
.kv{display:grid;grid-template-columns:max-content 1fr;gap:2px 12px}.kv b{font-weight:600}
figure{margin:0}svg{max-width:100%;height:auto}
"""

SCRIPT = r"""
(function(){
const D = JSON.parse(document.getElementById('meclear-data').textContent);
const Q = D.queries, tb = document.querySelector('#qtable tbody'), search = document.getElementById('qsearch');
const cols = ['pool','query','question','status','harmful','baseline','cleared_utility','evaluations'];
let order = Q.map((_, i) => i), sortCol = null, asc = true;
function td(tr, text, cls){const c=document.createElement('td'); c.textContent = text; if(cls) c.className=cls; tr.appendChild(c); return c;}
function fmt(v){return v === null || v === undefined ? '' : (typeof v === 'number' ? (Number.isInteger(v) ? String(v) : v.toFixed(3)) : String(v));}
// Rows are built on demand, PAGE at a time: the full LoCoMo audit has 1,986 queries, and laying out every row at load
// made the page slower to open; search and sort still run over all queries.
const PAGE = 200; let limit = PAGE;
const more = document.getElementById('qmore');
more.addEventListener('click', () => { limit += PAGE * 5; render(); });
function render(){
  const needle = search.value.toLowerCase(); const frag = document.createDocumentFragment(); let shown = 0, match = 0;
  for (const i of order){
    const q = Q[i];
    if (needle && !(q.pool + ' ' + q.query + ' ' + q.question + ' ' + q.status + ' ' + q.mem_ids).toLowerCase().includes(needle)) continue;
    if (++match > limit) continue;
    const tr = document.createElement('tr'); tr.dataset.i = i;
    td(tr, q.pool); td(tr, q.query, 'mono'); td(tr, q.question.length > 90 ? q.question.slice(0, 89) + '…' : q.question);
    td(tr, q.status, 'st-' + q.status); td(tr, fmt(q.harmful), 'n'); td(tr, fmt(q.baseline), 'n');
    td(tr, fmt(q.cleared_utility), 'n'); td(tr, fmt(q.evaluations), 'n');
    frag.appendChild(tr); shown++;
  }
  tb.replaceChildren(frag);
  document.getElementById('qcount').textContent = (match > shown ? 'showing ' + shown + ' of ' : '') + match + ' matching, ' + Q.length + ' queries';
  more.hidden = match <= shown; more.textContent = 'show ' + Math.min(match - shown, PAGE * 5) + ' more';
}
document.querySelectorAll('#qtable th').forEach((th, n) => th.addEventListener('click', () => {
  const c = cols[n]; asc = sortCol === c ? !asc : true; sortCol = c;
  order.sort((a, b) => { const x = Q[a][c], y = Q[b][c]; const r = (x === null) - (y === null) || (x < y ? -1 : x > y ? 1 : 0); return asc ? r : -r; });
  render();
}));
search.addEventListener('input', () => { limit = PAGE; render(); });
tb.addEventListener('click', e => { const tr = e.target.closest('tr'); if (tr) show(+tr.dataset.i, true); });
async function unpack(b64){
  const bytes = Uint8Array.from(atob(b64), c => c.charCodeAt(0));
  const stream = new Blob([bytes]).stream().pipeThrough(new DecompressionStream('gzip'));
  return await new Response(stream).text();
}
function el(tag, text, cls){const e = document.createElement(tag); if (text !== undefined) e.textContent = text; if (cls) e.className = cls; return e;}
function table(head, rows){
  const t = el('table'), h = t.createTHead().insertRow();
  head.forEach(x => { const th = el('th', x); h.appendChild(th); });
  const b = t.createTBody(); rows.forEach(r => { const tr = b.insertRow(); if (r.cls) tr.className = r.cls; r.cells.forEach(c => td(tr, fmt(c))); });
  return t;
}
async function show(i, push){
  const q = Q[i], box = document.getElementById('detail'); box.hidden = false;
  document.querySelectorAll('#qtable tr.sel').forEach(r => r.classList.remove('sel'));
  const row = tb.querySelector('tr[data-i="' + i + '"]'); if (row) row.classList.add('sel');
  if (push) history.replaceState(null, '', '#q=' + encodeURIComponent(q.pool + '/' + q.query));
  const body = document.getElementById('detail-body'); body.replaceChildren();
  body.appendChild(el('h3', q.pool + ' / ' + q.query));
  const kv = el('div', undefined, 'kv');
  const pairs = [['question', q.question], ['options', q.options.join(' | ')], ['gold answer', q.gold],
    ['answer, full context', fmt(q.before)], ['answer after clearance', fmt(q.after)], ['status', q.status],
    ['cleared', q.cleared.length ? q.cleared.join(', ') : 'nothing' + (q.reason ? ' (' + q.reason + ')' : '')],
    ['utility before → after', fmt(q.baseline) + ' → ' + fmt(q.cleared_utility)],
    ['agent evaluations', fmt(q.evaluations) + ' (' + q.estimator + ')']];
  pairs.forEach(([k, v]) => { kv.appendChild(el('b', k)); kv.appendChild(el('span', v)); });
  body.appendChild(kv);
  body.appendChild(el('h3', 'Frozen context, in retrieval order'));
  body.appendChild(table(['pos', 'memory', 'text', 'Shapley', '±SE', 'LOO', 'harm rank'],
    q.memories.map((m, p) => ({cls: m.harmful ? 'harm' : '', cells: [p, m.id, m.text, m.shapley, m.se, m.loo, m.rank]}))));
  const fig = el('figure'); body.appendChild(el('h3', 'Shapley values beside LOO, and pairwise interactions'));
  body.appendChild(fig);
  if (q.figure) { fig.innerHTML = await unpack(q.figure); }  // matplotlib SVG, labels escaped by matplotlib
  else fig.appendChild(el('p', 'No figure for this query (no harmful memory; the values are in the table above).', 'muted'));
  body.appendChild(el('h3', 'Nested clearance candidates (most harmful first)'));
  body.appendChild(table(['removed', 'utility', 'answer', 'gold answer?', 'chosen', 'ranking'],
    q.candidates.map(c => ({cls: c.chosen ? 'chosen' : '', cells: [c.removed.length ? c.removed.join(', ') : '(nothing)',
      c.utility, c.answer, c.correct === null ? '' : (c.correct ? 'yes' : 'no'), c.chosen ? '✔ chosen' : '',
      c.source || '']}))));
  document.body.dataset.detail = q.pool + '/' + q.query;
}
render();
const m = location.hash.match(/^#q=(.*)$/);
if (m) { const key = decodeURIComponent(m[1]); const i = Q.findIndex(q => q.pool + '/' + q.query === key); if (i >= 0) show(i, false); }
document.body.dataset.renderMs = Math.round(performance.now());  // navigation start -> list built
requestAnimationFrame(() => setTimeout(() => { document.body.dataset.paintMs = Math.round(performance.now()); }));
})();
"""


def esc(value) -> str:
    return html.escape(no_bidi("" if value is None else str(value)), quote=True)


def json_for_script(obj) -> str:
    """JSON safe inside <script type=application/json>: no `<`, `>` or `&` survive, so `</script>` cannot close it."""
    text = json.dumps(obj, ensure_ascii=False, allow_nan=False, default=_default, separators=(",", ":"))
    return text.replace("&", "\\u0026").replace("<", "\\u003c").replace(">", "\\u003e").replace(
        "\u2028", "\\u2028").replace("\u2029", "\\u2029")


def _default(o):
    import numpy as np

    if isinstance(o, np.generic):
        return o.item()
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


def clean(v):
    """NaN/inf -> None, recursively (JSON has no NaN); bidi controls in text made visible (`no_bidi`)."""
    if isinstance(v, float):
        return v if math.isfinite(v) else None
    if isinstance(v, str):
        return no_bidi(v)
    if isinstance(v, dict):
        return {(no_bidi(k) if isinstance(k, str) else k): clean(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [clean(x) for x in v]
    return v


def html_table(head: list[str], rows: list[list], numeric: set[int] = frozenset()) -> str:
    th = "".join(f'<th class="n">{esc(h)}</th>' if i in numeric else f"<th>{esc(h)}</th>" for i, h in enumerate(head))
    body = "".join(
        "<tr>" + "".join(f'<td class="n">{esc(c)}</td>' if i in numeric else f"<td>{esc(c)}</td>" for i, c in enumerate(r))
        + "</tr>"
        for r in rows
    )
    return f"<table><thead><tr>{th}</tr></thead><tbody>{body}</tbody></table>"


def document(title: str, subtitle: str, sections: list[str], data: dict | None = None, script: bool = False) -> str:
    data_tag = (
        f'<script type="application/json" id="meclear-data">{json_for_script(clean(data))}</script>' if data is not None else ""
    )
    js = f"<script>{SCRIPT}</script>" if script else ""
    return (
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
        "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">"
        f"<title>{esc(title)}</title><style>{CSS}</style></head><body>"
        f"<header><h1>{esc(title)}</h1><p>{esc(subtitle)}</p></header><main>{''.join(sections)}</main>"
        f"{data_tag}{js}</body></html>\n"
    )
