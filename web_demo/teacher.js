// Teacher dashboard: the room's live feed over a WebSocket -> student list + transcript log.
// Server data is only ever inserted with textContent / attributes, never as HTML.
'use strict';

const MAX_BACKOFF_S = 10;
const NEAR_BOTTOM_PX = 48; // "at the bottom" tolerance for auto-scroll

const params = new URLSearchParams(location.search);
const room = params.get('room');
const token = params.get('token');

const $ = (id) => document.getElementById(id);
const feedStatus = $('feed-status');
const studentList = $('students');
const studentCount = $('student-count');
const feed = $('feed');
const jumpButton = $('jump');

const transcripts = new Set(); // utterance_ids shown: a history replay must not repeat them
const students = new Map();    // student_id -> <li>

let socket = null;
let backoffS = 1;

function setFeedStatus(text, state) {
  feedStatus.textContent = text;
  feedStatus.dataset.state = state;
}

function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

// --- students ----------------------------------------------------------------------------

function upsertStudent(id, name) {
  let li = students.get(id);
  name = name || li?.dataset.studentName || id;
  if (!li) {
    li = el('li', 'student');
    li.dataset.studentId = id;
    li.append(el('span', 'dot'), el('span', 'student-name'), el('span', 'student-state'));
    students.set(id, li);
  }
  if (li.dataset.studentName !== name) {
    li.dataset.studentName = name;
    li.querySelector('.student-name').textContent = name;
    li.remove(); // re-inserted below at its alphabetical place
  }
  if (!li.isConnected) {
    const next = [...studentList.children].find((other) =>
      other.dataset.studentName.localeCompare(li.dataset.studentName) > 0);
    studentList.insertBefore(li, next || null);
  }
  return li;
}

// present: in the room; speaking: voice detected right now. The state text is for screen readers
// and for anyone who cannot tell the indicator colours apart.
function setStudentState(li, { present, speaking }) {
  li.classList.toggle('left', !present);
  li.classList.toggle('speaking', present && speaking);
  li.querySelector('.student-state').textContent = !present ? 'left' : speaking ? 'speaking' : '';
  updateCount();
}

function updateCount() {
  const online = [...students.values()].filter((li) => !li.classList.contains('left')).length;
  studentCount.textContent = `${online} online`;
}

// The roster is the truth after a (re)connect: anyone not in it has left meanwhile.
function applyRoster(roster) {
  const present = new Set();
  for (const s of roster) {
    present.add(s.student_id);
    setStudentState(upsertStudent(s.student_id, s.student_name), { present: true, speaking: !!s.speaking });
  }
  for (const [id, li] of students) {
    if (!present.has(id)) setStudentState(li, { present: false, speaking: false });
  }
  updateCount();
}

function applyStudentEvent(ev) {
  const li = upsertStudent(ev.student_id, ev.student_name);
  const speaking = ev.type === 'speaking_started';
  setStudentState(li, { present: ev.type !== 'student_left', speaking });
}

// --- transcripts -------------------------------------------------------------------------

const timeFormat = new Intl.DateTimeFormat([], { hour: '2-digit', minute: '2-digit', second: '2-digit' });

function renderTranscript(ev) {
  const item = el('li', 'transcript');
  item.dataset.studentName = ev.student_name;
  item.dataset.studentId = ev.student_id;
  item.dataset.utteranceId = ev.utterance_id;
  item.dataset.publishedTs = ev.published_ts;

  const meta = el('div', 'meta');
  const shownTs = ev.start_ts ?? ev.published_ts;
  const time = el('time', 'time', Number.isFinite(shownTs) ? timeFormat.format(shownTs * 1000) : '');
  if (Number.isFinite(shownTs)) time.dateTime = new Date(shownTs * 1000).toISOString();
  meta.append(time, el('span', 'name', ev.student_name));
  if (ev.language) meta.append(el('span', 'language', ev.language));

  const latency = ev.published_ts - ev.end_of_speech_ts;
  const latencyEl = el('span', 'latency', Number.isFinite(latency) ? `${latency.toFixed(2)} s` : '–');
  latencyEl.title = 'From the end of speech to the transcript';
  meta.append(latencyEl);

  if (ev.intent && ev.intent.label) {
    // The label becomes a class name: keep only characters that are safe there.
    const label = String(ev.intent.label);
    const badge = el('span', `intent intent-${label.toLowerCase().replace(/[^a-z0-9_-]+/g, '-')}`, label);
    if (Number.isFinite(ev.intent.score)) badge.title = `confidence ${Math.round(ev.intent.score * 100)} %`;
    meta.append(badge);
  }

  const text = el('p', 'text', ev.text);
  // Lets the browser and screen readers pick the right font and voice (e.g. for Chinese).
  if (ev.language && /^[a-z]{2,3}(-[A-Za-z0-9]+)*$/.test(ev.language)) text.lang = ev.language;
  item.append(meta, text);
  return item;
}

function isNearBottom() {
  return feed.scrollHeight - feed.scrollTop - feed.clientHeight < NEAR_BOTTOM_PX;
}

function scrollToBottom() {
  feed.scrollTop = feed.scrollHeight;
  jumpButton.hidden = true;
}

// Adds the transcripts not shown yet, in publish order, and follows the newest one unless the
// teacher has scrolled up to read.
function addTranscripts(events) {
  const follow = isNearBottom();
  let added = 0;
  for (const ev of events) {
    if (ev.type !== 'transcript' || !ev.utterance_id || transcripts.has(ev.utterance_id)) continue;
    transcripts.add(ev.utterance_id);
    const item = renderTranscript(ev);
    // Usually appended; a history replay can fill a gap left during a disconnection.
    let before = null;
    for (let node = feed.lastElementChild; node && Number(node.dataset.publishedTs) > ev.published_ts;
      node = node.previousElementSibling) before = node;
    feed.insertBefore(item, before);
    added++;
  }
  if (!added) return;
  if (follow) scrollToBottom();
  else jumpButton.hidden = false;
}

jumpButton.addEventListener('click', scrollToBottom);
feed.addEventListener('scroll', () => { if (isNearBottom()) jumpButton.hidden = true; });

// --- the feed socket ---------------------------------------------------------------------

function handle(msg) {
  switch (msg.type) {
    case 'history':
      backoffS = 1; // the server is really answering: a later drop starts from 1 s again
      addTranscripts(msg.events || []);
      break;
    case 'roster':
      applyRoster(msg.students || []);
      break;
    case 'transcript':
      addTranscripts([msg]);
      break;
    case 'student_joined':
    case 'student_left':
    case 'speaking_started':
    case 'speaking_stopped':
      applyStudentEvent(msg);
      break;
  }
  if (msg.room_name) $('room-name').textContent = msg.room_name;
}

function feedUrl(scheme) {
  return `${scheme}//${location.host}/api/rooms/${encodeURIComponent(room)}/feed?token=${encodeURIComponent(token)}`;
}

function connect() {
  setFeedStatus('connecting…', 'connecting');
  const ws = new WebSocket(feedUrl(location.protocol === 'https:' ? 'wss:' : 'ws:'));
  socket = ws;
  let opened = false;
  ws.addEventListener('open', () => {
    opened = true;
    setFeedStatus('live', 'live');
  });
  ws.addEventListener('message', (e) => {
    let msg;
    try { msg = JSON.parse(e.data); } catch { return; }
    if (msg && typeof msg === 'object') handle(msg);
  });
  ws.addEventListener('close', () => {
    if (socket !== ws) return;
    // Students' speaking state is unknown while offline; the next roster sets it again.
    for (const li of students.values()) li.classList.remove('speaking');
    if (opened) reconnectLater(); else explainRefusal();
  });
}

// A refused WebSocket tells the page nothing; the same URL over plain HTTP returns the server's
// JSON error, so a wrong or expired token is reported instead of retried forever.
async function explainRefusal() {
  try {
    const resp = await fetch(feedUrl(location.protocol));
    if ([401, 403, 404].includes(resp.status)) {
      const body = await resp.json().catch(() => ({}));
      setFeedStatus(`offline: ${body.error || `HTTP ${resp.status}`}`, 'error');
      return;
    }
  } catch { /* server unreachable: just retry */ }
  reconnectLater();
}

function reconnectLater() {
  const delayS = backoffS;
  backoffS = Math.min(backoffS * 2, MAX_BACKOFF_S);
  setFeedStatus(`reconnecting in ${delayS} s…`, 'reconnecting');
  setTimeout(connect, delayS * 1000);
}

$('room-name').textContent = room || '–';
if (room && token) {
  connect();
} else {
  setFeedStatus('offline: the link needs ?room=…&token=…', 'error');
}
