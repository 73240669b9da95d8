// Teacher dashboard: the room's live feed over a WebSocket -> student list, transcript log with
// intent badges, per-label counts and a queue of questions / help requests to handle.
// Server data is only ever inserted with textContent / attributes, never as HTML.
'use strict';

const NEAR_BOTTOM_PX = 48; // "at the bottom" tolerance for auto-scroll
// A lecture of thousands: the feed keeps its newest rows in the page (the whole class's
// transcript is the export), and the student list shows who is speaking, or who matches the
// search, once the room is this large; the counts say the rest.
const FEED_ROWS_KEPT = 400;
const FEED_ROWS_LECTURE = 100; // two hundred finals a second: the newest half second is plenty
const FEED_ROWS_READING = 1200;
const QUEUE_ROWS_KEPT = 200; // the newest questions; a lecture's are read as groups
const LARGE_ROOM = 200;
const ROSTER_ROWS = 100; // a lecture's list: who speaks or matches, the first this many by name
// A lecture's hundreds of speakers: live captions of this many at once (their finals all come).
const CAPTION_ROWS = 50;
// A lecture's question groups: the newest shown, as many kept as the server keeps
// (intent/groups.py MAX_GROUPS).
const GROUPS_SHOWN = 30;
const GROUPS_KEPT = 2000;
// Utterance ids remembered so that a history replay (at most the server's last 500 events)
// repeats nothing: a class of hours must not keep every id it ever saw.
const IDS_KEPT = 20000;
const MAX_CLEARED_STORED = 2000; // cleared queue ids kept in sessionStorage (newest kept)

// What the teacher reads for each intent label; an unknown label is shown as it is.
const INTENT_TEXT = new Map([
  ['question', 'question'],
  ['help_request', 'needs help'],
  ['answer', 'answer'],
  ['acknowledgement', 'ok'],
  ['off_task', 'off task'],
  ['unsure', 'unsure'], // the counter for transcripts whose label is null
]);
const QUEUE_LABELS = new Set(['question', 'help_request']);
const UNSURE = 'unsure';

// The link carries room and token in its fragment (#room=…&token=…), which the browser never
// sends to a server (no Referer, no access log); links of older servers had them in the query.
const fragment = new URLSearchParams(location.hash.slice(1));
const query = new URLSearchParams(location.search);
const param = (key) => fragment.get(key) ?? query.get(key);
const room = param('room');
const token = param('token');

// The whole class's final transcripts (not only what this page has shown), from the server; srt
// and vtt are subtitles timed from the class's first speech.
for (const format of ['txt', 'csv', 'json', 'srt', 'vtt']) {
  const link = document.getElementById(`export-${format}`);
  if (link) {
    link.href = `/api/rooms/${encodeURIComponent(room)}/transcript?format=${format}&token=${encodeURIComponent(token)}`;
  }
}

const $ = (id) => document.getElementById(id);
const feedStatus = $('feed-status');
const studentList = $('students');
const studentCount = $('student-count');
const feed = $('feed');
const jumpButton = $('jump');
const labelCounts = $('label-counts');
const queue = $('queue');
const queueCount = $('queue-count');
const clearAllButton = $('queue-clear-all');

const transcripts = new Set(); // utterance_ids shown: a history replay must not repeat them
const partials = new Map();    // utterance_id -> its live caption's element, until its final comes
const captionsEnded = new Set(); // utterance_ids the queue refused: a caption of theirs still in flight is not shown
const PARTIAL_GONE_MS = 15000; // a caption not updated or finalised this long is dropped (its speech was given up)
const students = new Map();    // student_id -> its record (drawn as a row while listed)
const byName = [];             // the records in alphabetical order (binary search: joins of a lecture)
let online = 0;                // students present, kept as they come and go (never recounted)
let speakingNow = 0;
let search = '';               // the student search, lower case
const counts = new Map();      // intent label (or UNSURE) -> number of transcripts
const queued = new Map();      // utterance_id -> <li> in the queue
const groups = new Map();      // group_id -> its newest question_group event, least recently grown first
const groupItems = new Map();  // group_id -> <li>, for the groups shown
let groupsDrawn = true;        // false: a frame will draw them

// Utterance ids the teacher marked done: they stay out of the queue after a reconnect's history
// replay or a reload of this tab.
const clearedKey = `streamserver.queue-cleared.${room}`;
const cleared = loadCleared();

let socket = null;
let failures = 0; // reconnects in a row that did not reach the feed

function setFeedStatus(text, state) {
  feedStatus.textContent = text;
  feedStatus.dataset.state = state;
}

// Adds id to a Set used as a memory of recent ids (insertion order), forgetting the oldest past `most`.
function remember(ids, id, most = IDS_KEPT) {
  ids.add(id);
  if (ids.size > most) ids.delete(ids.values().next().value);
}

// Makes list's children exactly `rows`, in that order, with as few DOM changes as it takes: rows
// no longer wanted leave, the others stay where they are, new ones go in their place. Returns
// those that left.
function arrange(list, rows) {
  const wanted = new Set(rows);
  const gone = [...list.children].filter((node) => !wanted.has(node));
  for (const node of gone) node.remove();
  let next = list.firstElementChild;
  for (const row of rows) {
    if (row === next) next = next.nextElementSibling;
    else list.insertBefore(row, next);
  }
  return gone;
}

function el(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

// --- students ----------------------------------------------------------------------------

// The class is kept as records ({ id, name, key, present, speaking, li }); the list shows rows
// for some of them, drawn at most once a frame. A lecture's ten thousand students are no ten
// thousand elements: the list holds who is speaking, or who matches the search, at most
// ROSTER_ROWS of them, and says how many more there are.
const byNameOrder = new Intl.Collator();
const rosterMore = $('students-more');
let rosterDrawn = true; // false: a frame will draw the list

// Where a name goes in byName: after every name that sorts before or equal to it.
function placeOf(name) {
  let low = 0;
  let high = byName.length;
  while (low < high) {
    const mid = (low + high) >> 1;
    if (byNameOrder.compare(byName[mid].name, name) <= 0) low = mid + 1;
    else high = mid;
  }
  return low;
}

function upsertStudent(id, name) {
  let student = students.get(id);
  name = name || student?.name || id;
  if (!student) {
    student = { id, name: undefined, key: '', present: false, speaking: false, li: null };
    students.set(id, student);
  }
  if (student.name !== name) {
    if (student.name !== undefined) byName.splice(byName.indexOf(student), 1); // renamed: moves
    student.name = name;
    student.key = name.toLowerCase();
    byName.splice(placeOf(name), 0, student);
    student.li?.remove(); // drawn again in its new place
    student.li = null;
    redrawRoster();
  }
  return student;
}

const isLecture = () => students.size > LARGE_ROOM;
const feedRows = () => (isLecture() ? FEED_ROWS_LECTURE : FEED_ROWS_KEPT);

// A lecture lists who is speaking (and, while the teacher searches, who matches); a small room
// lists everyone who came.
function isListed(student, lecture) {
  if (search) return student.key.includes(search);
  return !lecture || student.speaking;
}

function applySearch() {
  search = $('student-search').value.trim().toLowerCase();
  drawRoster(); // now: the teacher is typing
}

// present: in the room; speaking: voice detected right now.
function setStudentState(student, { present, speaking }) {
  speaking = present && speaking;
  if (student.present === present && student.speaking === speaking) return;
  online += (present ? 1 : 0) - (student.present ? 1 : 0);
  speakingNow += (speaking ? 1 : 0) - (student.speaking ? 1 : 0);
  student.present = present;
  student.speaking = speaking;
  if (student.li) paintStudent(student);
  redrawRoster();
}

// The state text is for screen readers and for anyone who cannot tell the indicator colours apart.
function paintStudent(student) {
  const li = student.li;
  li.classList.toggle('left', !student.present);
  li.classList.toggle('speaking', student.speaking);
  li.querySelector('.student-state').textContent = !student.present ? 'left' : student.speaking ? 'speaking' : '';
}

function studentItem(student) {
  const li = el('li', 'student');
  li.dataset.studentId = student.id;
  li.append(el('span', 'dot'), el('span', 'student-name', student.name), el('span', 'student-state'));
  student.li = li;
  paintStudent(student);
  return li;
}

function redrawRoster() {
  if (rosterDrawn) {
    rosterDrawn = false;
    requestAnimationFrame(drawRoster);
  }
}

// The list's rows follow the records, in name order (arrange).
function drawRoster() {
  rosterDrawn = true;
  const lecture = isLecture();
  studentList.classList.toggle('lecture', lecture);
  studentList.dataset.empty = search ? 'Nobody by that name' : lecture ? 'Nobody is speaking' : 'No students yet';
  const rows = [];
  let more = 0;
  for (const student of byName) {
    if (!isListed(student, lecture)) continue;
    if (!lecture || rows.length < ROSTER_ROWS) rows.push(student);
    else more++;
  }
  for (const li of arrange(studentList, rows.map((student) => student.li ?? studentItem(student)))) {
    const student = students.get(li.dataset.studentId);
    if (student) student.li = null;
  }
  rosterMore.hidden = more === 0;
  rosterMore.textContent = `and ${more} more ${search ? 'found: type more of the name' : 'speaking'}`;
  studentCount.textContent = lecture ? `${online} online · ${speakingNow} speaking` : `${online} online`;
}

// The roster is the truth after a (re)connect: anyone not in it has left meanwhile.
function applyRoster(roster) {
  const present = new Set();
  for (const s of roster) {
    present.add(s.student_id);
    setStudentState(upsertStudent(s.student_id, s.student_name), { present: true, speaking: !!s.speaking });
  }
  for (const [id, student] of students) {
    if (!present.has(id)) setStudentState(student, { present: false, speaking: false });
  }
}

function applyStudentEvent(ev) {
  const student = upsertStudent(ev.student_id, ev.student_name);
  const speaking = ev.type === 'speaking_started';
  setStudentState(student, { present: ev.type !== 'student_left', speaking });
}

// --- transcripts -------------------------------------------------------------------------

const timeFormat = new Intl.DateTimeFormat([], { hour: '2-digit', minute: '2-digit', second: '2-digit' });

// { label: string | null, score: number | null }; label null: the classifier is not sure.
function intentOf(ev) {
  const intent = ev.intent && typeof ev.intent === 'object' ? ev.intent : {};
  const label = typeof intent.label === 'string' && intent.label ? intent.label : null;
  const score = Number.isFinite(intent.score) ? Math.min(1, Math.max(0, intent.score)) : null;
  return { label, score };
}

const labelText = (label) => INTENT_TEXT.get(label) ?? label.replace(/_/g, ' ');
// The label becomes a class name: keep only characters that are safe there.
const labelClass = (label) => `intent-${label.toLowerCase().replace(/[^a-z0-9_-]+/g, '-')}`;

function intentBadge({ label, score }) {
  const badge = el('span', `intent ${labelClass(label)}`, labelText(label));
  if (score !== null) badge.title = `confidence ${Math.round(score * 100)}%`;
  return badge;
}

function timeOf(ev) {
  const shownTs = ev.start_ts ?? ev.published_ts;
  const time = el('time', 'time', Number.isFinite(shownTs) ? timeFormat.format(shownTs * 1000) : '');
  if (Number.isFinite(shownTs)) time.dateTime = new Date(shownTs * 1000).toISOString();
  return time;
}

function textOf(ev) {
  const text = el('p', 'text', ev.text);
  // Lets the browser and screen readers pick the right font and voice (e.g. for Chinese).
  if (ev.language && /^[a-z]{2,3}(-[A-Za-z0-9]+)*$/.test(ev.language)) text.lang = ev.language;
  return text;
}

function renderTranscript(ev, intent) {
  const item = el('li', 'transcript');
  item.dataset.studentName = ev.student_name;
  item.dataset.studentId = ev.student_id;
  item.dataset.utteranceId = ev.utterance_id;
  item.dataset.spokenTs = spokenTs(ev);
  item.dataset.label = intent.label ?? UNSURE;

  const meta = el('div', 'meta');
  meta.append(timeOf(ev), el('span', 'name', ev.student_name));
  if (ev.language) meta.append(el('span', 'language', ev.language));

  const latency = ev.published_ts - ev.end_of_speech_ts;
  const latencyEl = el('span', 'latency', Number.isFinite(latency) ? `${latency.toFixed(2)} s` : '–');
  latencyEl.title = 'From the end of speech to the transcript';
  meta.append(latencyEl);

  if (intent.label) meta.append(intentBadge(intent)); // not sure: no badge
  if (ev.recovered) { // spoken during a break of the student's connection, sent again by their page
    item.classList.add('recovered');
    const badge = el('span', 'recovered-badge', 'recovered');
    badge.title = 'Said while the student\'s connection was broken; their page kept it and sent it again (the time is when it was said)';
    meta.append(badge);
  }

  item.append(meta, textOf(ev));
  return item;
}

// A live caption (transcript_partial): shown in place, a newer revision updates its text, its
// final replaces it for good; one that comes after its final, or an older revision, is ignored.
function showPartial(ev) {
  if (!ev.utterance_id || transcripts.has(ev.utterance_id) || captionsEnded.has(ev.utterance_id)) return;
  const old = partials.get(ev.utterance_id);
  if (old && Number(old.dataset.revision) >= ev.revision) return;
  if (old) { // a lecture's thousand captions a second: the row stays, its words change
    old.dataset.revision = ev.revision;
    old.querySelector('.text').textContent = ev.text;
    old.shownAt = Date.now();
    grew.captions = true;
    return;
  }
  if (partials.size >= CAPTION_ROWS) return; // a later revision shows once a row is free
  const item = renderTranscript(ev, { label: null, score: null });
  item.classList.add('partial');
  item.dataset.revision = ev.revision;
  item.setAttribute('aria-label', `${ev.student_name} is speaking`);
  const latency = item.querySelector('.latency');
  latency.textContent = 'speaking';
  latency.title = 'Provisional: the student is still speaking';
  insertInOrder(feed, item, spokenTs(ev));
  item.shownAt = Date.now();
  partials.set(ev.utterance_id, item);
  grew.captions = true;
}

// Captions whose speech was given up (not updated or finalised for PARTIAL_GONE_MS) leave, swept
// now and then rather than timed one by one.
setInterval(() => {
  const now = Date.now();
  for (const [id, item] of partials) {
    if (now - item.shownAt > PARTIAL_GONE_MS) {
      item.remove();
      partials.delete(id);
    }
  }
}, PARTIAL_GONE_MS / 3);

// When it was said: where a transcript goes in the feed. Not when it was published: a recovered
// utterance (sent again after a break) or one recognised by a slower worker is published after
// later speech of the same student, and the class reads in the order it was spoken. A history
// replay after a disconnection fills its gap the same way.
function spokenTs(ev) {
  const ts = ev.start_ts ?? ev.end_of_speech_ts ?? ev.published_ts;
  return Number.isFinite(ts) ? ts : Infinity;
}

// A row said before every row of a full list: the next trim would take it at once (a lecture's
// finals come 200 a second), so it is not made at all.
function wouldBeTrimmed(list, rows, most, ts) {
  return rows >= most && ts < list.firstElementChild.spokenAt;
}

// Inserts item into list by spokenTs: usually at the end.
function insertInOrder(list, item, ts) {
  item.spokenAt = ts; // read back by later insertions: a property, not the attribute parsed again
  let before = null;
  for (let node = list.lastElementChild; node && node.spokenAt > ts; node = node.previousElementSibling) before = node;
  list.insertBefore(item, before);
}

function isNearBottomOf(list) {
  return list.scrollHeight - list.scrollTop - list.clientHeight < NEAR_BOTTOM_PX;
}

// --- label counts ------------------------------------------------------------------------

function countLabel(label) {
  const key = label ?? UNSURE;
  counts.set(key, (counts.get(key) || 0) + 1);
  grew.counts = true;
}

// The chips show the counts as a batch left them (a lecture's finals: 200 a second).
function drawCounts() {
  for (const [key, n] of counts) {
    let chip = [...labelCounts.children].find((node) => node.dataset.label === key);
    if (!chip) { // a label this page does not know yet
      chip = el('li', `label-count ${labelClass(key)}`);
      chip.dataset.label = key;
      chip.append(el('span', 'label-name', labelText(key)), ' ', el('span', 'n'));
      labelCounts.append(chip);
    }
    if (chip.dataset.count === String(n)) continue;
    chip.dataset.count = n;
    chip.querySelector('.n').textContent = String(n);
  }
}

// --- questions & help queue --------------------------------------------------------------

function loadCleared() {
  try {
    const ids = JSON.parse(sessionStorage.getItem(clearedKey) || '[]');
    return new Set(Array.isArray(ids) ? ids.filter((id) => typeof id === 'string') : []);
  } catch {
    return new Set();
  }
}

function saveCleared() {
  try {
    sessionStorage.setItem(clearedKey, JSON.stringify([...cleared].slice(-MAX_CLEARED_STORED)));
  } catch { /* storage full or disabled: cleared for this page only */ }
}

function enqueue(ev, intent) {
  if (!QUEUE_LABELS.has(intent.label) || cleared.has(ev.utterance_id) || queued.has(ev.utterance_id)) return false;
  if (wouldBeTrimmed(queue, queued.size, QUEUE_ROWS_KEPT, spokenTs(ev))) return false;
  const item = el('li', 'queue-item');
  item.dataset.utteranceId = ev.utterance_id;
  item.dataset.label = intent.label;
  item.dataset.studentId = ev.student_id;
  item.dataset.spokenTs = spokenTs(ev);

  const meta = el('div', 'meta');
  meta.append(intentBadge(intent), el('span', 'name', ev.student_name), timeOf(ev));
  const done = el('button', 'clear secondary small', 'done');
  done.type = 'button';
  done.setAttribute('aria-label', `Done: ${labelText(intent.label)} from ${ev.student_name}`);
  done.addEventListener('click', () => clearQueued([ev.utterance_id]));

  item.append(meta, textOf(ev), done);
  insertInOrder(queue, item, spokenTs(ev));
  queued.set(ev.utterance_id, item);
  return true;
}

// Marks these queue items as handled: removed now and kept out of later history replays.
function clearQueued(ids) {
  const focused = queue.contains(document.activeElement) ? document.activeElement.closest('.queue-item') : null;
  let focusNext = null;
  if (focused && ids.includes(focused.dataset.utteranceId)) {
    // Keyboard users continue with the neighbouring item instead of losing their place.
    for (const sibling of [focused.nextElementSibling, focused.previousElementSibling]) {
      if (sibling && !ids.includes(sibling.dataset.utteranceId)) { focusNext = sibling; break; }
    }
  }
  for (const id of ids) {
    cleared.add(id);
    queued.get(id)?.remove();
    queued.delete(id);
  }
  saveCleared();
  updateQueueCount();
  if (focused && !focused.isConnected) (focusNext?.querySelector('.clear') ?? queue).focus();
}

function updateQueueCount() {
  queueCount.textContent = String(queued.size);
  queueCount.dataset.count = queued.size;
  clearAllButton.disabled = queued.size === 0;
}

clearAllButton.addEventListener('click', () => {
  clearQueued([...queued.keys()]);
  queue.focus(); // the button just became disabled
});

// Whether the feed and the queue follow their newest rows: yes until the teacher scrolls up to
// read, again once they are back at the bottom. Kept from the lists' scroll events, so that a batch
// of events never has to measure the page (a layout of its own) before it changes it.
const following = { feed: true, queue: true };
const placedAt = { feed: 0, queue: 0 }; // where the page last scrolled each list to

function noteScroll(name, list) {
  if (list.scrollTop < placedAt[name] - 2) following[name] = isNearBottomOf(list); // moved up: reading?
  else if (!following[name] && isNearBottomOf(list)) following[name] = true;
  if (name === 'feed' && following.feed) jumpButton.hidden = true;
}

function placeAtBottom(name, list) {
  list.scrollTop = list.scrollHeight;
  placedAt[name] = list.scrollTop;
}

function scrollToBottom() {
  following.feed = true;
  trimFeed();
  placeAtBottom('feed', feed);
  jumpButton.hidden = true;
}

// Adds the transcripts not shown yet, in publish order, counts their labels and queues the
// questions and help requests (the feed and the queue follow them as a batch ends: settle).
function addTranscripts(events) {
  for (const ev of events) {
    if (!ev || ev.type !== 'transcript' || !ev.utterance_id || transcripts.has(ev.utterance_id)) continue;
    remember(transcripts, ev.utterance_id);
    const intent = intentOf(ev);
    const partial = partials.get(ev.utterance_id);
    if (partial) { // the final takes the caption's place
      const item = renderTranscript(ev, intent);
      partials.delete(ev.utterance_id);
      item.spokenAt = partial.spokenAt;
      partial.replaceWith(item);
      grew.feed = true;
    } else if (!(following.feed && wouldBeTrimmed(feed, feed.children.length, feedRows(), spokenTs(ev)))) {
      insertInOrder(feed, renderTranscript(ev, intent), spokenTs(ev));
      grew.feed = true;
    }
    countLabel(intent.label);
    if (enqueue(ev, intent)) grew.queue = true;
  }
}

// What batches of events added: the feed and the queue follow their newest item unless the
// teacher has scrolled up to read. Settled at the next frame, where the page is laid out anyway.
const grew = { feed: false, captions: false, queue: false, counts: false };
let settling = false;

function settleLater() {
  if (!settling && (grew.feed || grew.captions || grew.queue || grew.counts)) {
    settling = true;
    requestAnimationFrame(settle);
  }
}

// Every change first, then the lists' scroll positions: the first scrollHeight lays the page out
// once for both lists, where a change between the two reads would lay it out again.
function settle() {
  settling = false;
  const feedGrew = grew.feed || grew.captions;
  if (grew.counts) drawCounts();
  if (grew.queue) {
    trimQueue();
    updateQueueCount();
  }
  if (feedGrew) trimFeed();
  if (feedGrew && !following.feed && grew.feed) jumpButton.hidden = false;
  if (grew.queue && following.queue) placeAtBottom('queue', queue);
  if (feedGrew && following.feed) placeAtBottom('feed', feed);
  grew.feed = grew.captions = grew.queue = grew.counts = false;
}

// The oldest rows leave the page once the feed holds FEED_ROWS_KEPT (never a live caption). While
// the teacher reads further up, it keeps up to FEED_ROWS_READING (a lecture adds hundreds a
// second meanwhile); the rest go when it follows again.
function trimFeed() {
  const most = following.feed ? feedRows() : FEED_ROWS_READING;
  for (let extra = feed.children.length - most; extra > 0; extra--) {
    const oldest = feed.firstElementChild;
    if (!oldest || oldest.classList.contains('partial')) break;
    oldest.remove();
  }
}

// The queue keeps its newest QUEUE_ROWS_KEPT questions (a lecture's come a hundred a minute).
function trimQueue() {
  for (let extra = queued.size - QUEUE_ROWS_KEPT; extra > 0; extra--) {
    const oldest = queue.firstElementChild;
    if (!oldest) break;
    queued.delete(oldest.dataset.utteranceId);
    oldest.remove();
  }
}

// --- question groups ---------------------------------------------------------------------

// A group as it stands (its count, students, representative question); drawn at the next frame,
// however many grew meanwhile.
function applyGroup(ev) {
  if (typeof ev.group_id !== 'string' && !Number.isInteger(ev.group_id)) return; // "<worker>:<n>"
  groups.delete(ev.group_id); // re-inserted: the Map stays in the order the groups last grew
  groups.set(ev.group_id, ev);
  if (groups.size > GROUPS_KEPT) groups.delete(groups.keys().next().value);
  redrawGroups();
}

// The teacher (or a TA, on any dashboard of the room) marked the group answered: shown so until
// a question joins it again (its next question_group event is open).
function applyAnswered(ev) {
  const g = groups.get(ev.group_id);
  if (!g) return;
  groups.set(ev.group_id, { ...g, answered: true }); // its place in the Map kept: it did not grow
  redrawGroups();
}

function redrawGroups() {
  if (groupsDrawn) {
    groupsDrawn = false;
    requestAnimationFrame(drawGroups);
  }
}

// POST .../question_groups/<id>/answered: the server tells every dashboard of the room, this one
// too (question_group_answered), so the button waits for that rather than marking it here.
async function markAnswered(groupId, button) {
  button.disabled = true;
  try {
    const resp = await fetch(`/api/rooms/${encodeURIComponent(room)}/question_groups/${encodeURIComponent(groupId)}/answered`, {
      method: 'POST', headers: { Authorization: `Bearer ${token}` },
    });
    if (!resp.ok) throw new Error(`${resp.status} ${(await resp.json().catch(() => ({}))).error || resp.statusText}`);
  } catch (err) {
    button.title = `not marked: ${err.message}`;
  } finally {
    button.disabled = false;
  }
}

function drawGroups() {
  groupsDrawn = true;
  const newest = [...groups.values()]
    .sort((a, b) => (b.last_at - a.last_at) || String(a.group_id).localeCompare(String(b.group_id)))
    .slice(0, GROUPS_SHOWN);
  const shown = new Set(newest.map((g) => g.group_id));
  for (const id of groupItems.keys()) if (!shown.has(id)) groupItems.delete(id);
  arrange($('groups'), newest.map(groupItem)); // a group that grew moves to the top, the others stay
  $('group-total').textContent = `${groups.size} ${groups.size === 1 ? 'group' : 'groups'}`;
  if ($('groups-box').hidden) { // the queue below gets shorter: it keeps following if it did
    $('groups-box').hidden = false;
    if (following.queue) placeAtBottom('queue', queue);
  }
}

function groupItem(g) {
  let li = groupItems.get(g.group_id);
  if (!li) {
    li = el('li', 'question-group');
    li.dataset.groupId = g.group_id;
    const answer = el('button', 'group-answer secondary small', 'answered');
    answer.type = 'button';
    answer.title = 'Mark this question answered on every dashboard of the room';
    answer.addEventListener('click', () => markAnswered(g.group_id, answer));
    li.append(el('span', 'group-count'), el('p', 'group-question'), el('span', 'group-students'), answer);
    groupItems.set(g.group_id, li);
  }
  li.querySelector('.group-answer').hidden = !!g.answered;
  li.dataset.count = g.count;
  li.classList.toggle('answered', !!g.answered);
  li.querySelector('.group-count').textContent = String(g.count);
  li.querySelector('.group-question').textContent = g.question;
  li.querySelector('.group-students').textContent = g.students === 1 ? '1 student' : `${g.students} students`;
  return li;
}

jumpButton.addEventListener('click', scrollToBottom);
feed.addEventListener('scroll', () => noteScroll('feed', feed));
queue.addEventListener('scroll', () => noteScroll('queue', queue));

// --- the feed socket ---------------------------------------------------------------------

// An on-prem gateway whose uplink is down transcribes on its own CPU (--fallback-model): the
// header says so, from its transcription_source events and the transcripts' fallback flag.
function setSource(source) {
  const pill = $('source');
  pill.dataset.source = source;
  pill.hidden = false; // shown once a gateway with a fallback has spoken of it: not on a plain serve
  pill.textContent = source === 'local' ? 'transcripts: this gateway (uplink down)' : 'transcripts: central workers';
}

function noteSource(events) {
  for (const ev of events) {
    if (ev && ev.type === 'transcription_source') setSource(ev.source);
    else if (ev && ev.type === 'transcript' && (ev.fallback || !$('source').hidden)) setSource(ev.fallback ? 'local' : 'central');
  }
}

// Events after which an utterance's live caption must not stay: its speech had no words after
// all, was given up, or was refused by the queue (which the feed then says, not silently).
const ENDS_CAPTION = new Set(['no_speech', 'utterance_failed', 'utterance_dropped']);

function endCaption(ev) {
  if (!ev.utterance_id) return;
  // A result: nothing more comes for it. A refused utterance is not a result (a gateway's own
  // recognition may still transcribe it): only its caption ends.
  const dropped = ev.type === 'utterance_dropped';
  if (dropped && !captionsEnded.has(ev.utterance_id) && !transcripts.has(ev.utterance_id)) showDropped(ev);
  remember(dropped ? captionsEnded : transcripts, ev.utterance_id);
  const caption = partials.get(ev.utterance_id);
  if (caption) {
    caption.remove();
    partials.delete(ev.utterance_id);
  }
}

// Speech the server could not take (its recognition queue was full for the student, the room or
// everyone): a line in the feed where it was said, so that the teacher knows words are missing.
function showDropped(ev) {
  const name = partials.get(ev.utterance_id)?.dataset.studentName ?? students.get(ev.student_id)?.name ?? 'A student';
  const item = el('li', 'dropped');
  item.dataset.utteranceId = ev.utterance_id;
  item.dataset.spokenTs = spokenTs(ev);
  item.append(el('span', 'name', name), el('span', 'why', ` was not transcribed: the server was too busy (${ev.reason || 'queue full'})`));
  insertInOrder(feed, item, spokenTs(ev));
}

function handle(msg) {
  noteSource(msg.type === 'history' ? (msg.events || []) : [msg]);
  switch (msg.type) {
    case 'history':
      failures = 0; // the server is really answering: a later drop starts from the shortest wait again
      addTranscripts(msg.events || []);
      for (const ev of msg.events || []) {
        if (ev && ENDS_CAPTION.has(ev.type)) endCaption(ev);
        else if (ev && ev.type === 'question_group') applyGroup(ev);
        else if (ev && ev.type === 'question_group_answered') applyAnswered(ev);
      }
      break;
    case 'roster':
      applyRoster(msg.students || []);
      break;
    case 'transcript':
      addTranscripts([msg]);
      break;
    case 'transcript_partial':
      showPartial(msg);
      break;
    case 'question_group':
      applyGroup(msg);
      break;
    case 'question_group_answered':
      applyAnswered(msg);
      break;
    case 'no_speech':
    case 'utterance_failed':
    case 'utterance_dropped':
      endCaption(msg);
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

// A lecture sends a thousand or more events a second, each its own message: they are handled
// in batches, at most every BATCH_MS, so that the page lays out and scrolls once per batch rather
// than once per event. A burst (a class that ends: every speaker's final at once) is handled in
// slices of SLICE_MS, so that the page still answers and draws in between.
const BATCH_MS = 100;
const SLICE_MS = 30;
let pending = [];
let flushing = false;

function receive(msg) {
  pending.push(msg);
  if (flushing) return;
  flushing = true;
  setTimeout(flush, BATCH_MS);
}

function flush() {
  const started = performance.now();
  let done = 0;
  while (done < pending.length && performance.now() - started < SLICE_MS) handle(pending[done++]);
  pending = done === pending.length ? [] : pending.slice(done);
  settleLater();
  if (pending.length) setTimeout(flush, 0);
  else flushing = false;
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
    if (msg && typeof msg === 'object') receive(msg);
  });
  ws.addEventListener('close', () => {
    if (socket !== ws) return;
    // Students' speaking state is unknown while offline; the next roster sets it again.
    for (const student of students.values()) setStudentState(student, { present: student.present, speaking: false });
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
  const delayS = reconnectWaitS(failures++);
  setFeedStatus(`reconnecting in ${Math.ceil(delayS)} s…`, 'reconnecting');
  setTimeout(connect, delayS * 1000);
}

$('room-name').textContent = room || '–';
if (room && token) {
  connect();
} else {
  setFeedStatus('offline: the link needs #room=…&token=…', 'error');
}

$('student-search').addEventListener('input', applySearch);
