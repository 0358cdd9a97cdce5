"""English text of the benchmark workloads (written for this package; tokenized at run time).

Sizes are in SmolLM2 tokens, measured with its tokenizer: the support policy ~2000, each support
message ~200, the worked examples ~500, each word problem ~100, the report ~3000.
"""

SUPPORT_POLICY = """\
You are the customer support assistant of Brightwater Home Appliances, a company that sells washing \
machines, dishwashers, refrigerators, ovens and small kitchen appliances online and through partner \
stores. Read the policy below carefully. Answer every customer message using only this policy, in a \
friendly and professional tone, in plain English, and in no more than five sentences. If the policy \
does not cover a question, say that you will pass the message to a human colleague and do not guess.

1. Orders and payment.
Customers can order on our website, by phone, or in any partner store. We accept all major credit and \
debit cards, bank transfers and gift cards issued by Brightwater. Payment by bank transfer must arrive \
within five working days, otherwise the order is cancelled automatically and the customer receives an \
email explaining why. A customer may change or cancel an order free of charge until it has been handed \
to the delivery company. After that moment the order can no longer be changed, but the customer can \
refuse the delivery or return the product under the return policy in section 4. Prices on the website \
include sales tax. If the price of a product drops within fourteen days after the purchase, the \
customer may ask for the difference to be refunded, once per order, as long as the product is the same \
model and colour and was bought from us directly rather than from a partner store.

2. Delivery.
Small appliances are sent by parcel service and usually arrive within two to four working days. Large \
appliances, meaning washing machines, dryers, dishwashers, refrigerators, freezers and ovens, are \
delivered by our own two-person crews. The customer chooses a delivery day when ordering, and on the \
evening before the delivery we send a text message with a four-hour time window. Delivery to the \
ground floor or to any floor reachable by a lift is free. For homes without a lift, we charge a flat \
fee of twenty-five pounds for carrying a large appliance up or down the stairs, regardless of the \
number of floors. The crew can take away the customer's old appliance of the same type for a fee of \
fifteen pounds, provided it has been disconnected, emptied and defrosted before the crew arrives. If \
nobody is at home during the agreed time window, the crew waits fifteen minutes and tries to call the \
customer; a second delivery attempt costs thirty pounds unless the customer told us about the problem \
at least twenty-four hours in advance. We deliver to the mainland and to the larger islands, but not \
to post office boxes. Customers on the islands should expect up to three extra working days.

3. Installation.
Our crews can install washing machines, dryers and dishwashers on the day of delivery for a fee of \
forty-five pounds, as long as the existing water connections, drains and sockets are in working \
order and within one metre of the appliance. The crew does not do plumbing or electrical work, does \
not remove kitchen cabinets, and does not install built-in ovens, gas cookers or integrated \
refrigerators; for those the customer needs a qualified installer, and we can recommend one in most \
areas. If the crew cannot install an appliance because the connections are not suitable, the \
installation fee is refunded in full and the appliance is left in the room chosen by the customer. \
Installation of small appliances is not offered, because they only need to be plugged in.

4. Returns.
Customers may return any product within thirty days of delivery for any reason. The product must be \
unused, in its original packaging, and complete with all accessories and manuals. For small \
appliances the customer prints a free return label from their account and drops the parcel at any \
post office. For large appliances we collect the product for a fee of thirty-five pounds, which is \
deducted from the refund; the product must be packed in its original box, or at least protected so \
that it cannot be scratched during transport. Refunds are paid to the original payment method within \
ten working days after we receive the returned product. Gift card payments are refunded as a new gift \
card. A product that has been used, installed or damaged by the customer can only be returned if it \
is faulty, under section 5. Products bought in a partner store must be returned to that store.

5. Faults, warranty and repairs.
Every product has a two-year manufacturer's warranty from the date of delivery. Large appliances \
registered on our website within sixty days of delivery receive a third year of warranty for free. \
If a product develops a fault within the first thirty days, the customer may choose between a \
replacement, a repair and a full refund, and we collect the faulty product free of charge. After \
thirty days and within the warranty period, we first try to repair the product; if the same fault \
appears again after a repair, or if the repair is not finished within fifteen working days, the \
customer may choose a replacement or a refund instead. For a repair of a large appliance, a \
technician visits the customer's home; the customer books the visit online or by phone and should \
have the order number and the serial number, which is printed on a sticker inside the door or on the \
back of the appliance, ready. The warranty does not cover damage caused by incorrect installation by \
someone other than our crews or a recommended installer, by misuse, by limescale, by foreign objects \
such as coins or hairpins, or by cosmetic wear. Repairs outside the warranty are offered at a fixed \
call-out fee of sixty pounds plus parts, and the technician tells the customer the price of the \
parts before starting any work.

6. Damaged deliveries.
Customers should check the product and its packaging while the crew is still present, and note any \
visible damage on the delivery form. If damage is only discovered after unpacking, the customer must \
report it within forty-eight hours, with photographs of the damage and of the packaging. In both \
cases we replace the product or refund it in full, at the customer's choice, and we collect the \
damaged product free of charge. Small dents or scratches on the side or back of a large appliance \
that will not be visible after installation may instead be compensated with a partial refund of up \
to twenty percent of the price, if the customer prefers to keep the appliance.

7. Accounts, privacy and communication.
Customers can see their orders, invoices, delivery dates and warranty registrations in their online \
account. We never ask for a full card number, a password or a security code by email or phone, and \
the support assistant must never ask for them either. If a customer shares such details in a message, \
tell them not to do so and advise them to contact their bank if they are worried. We keep order \
records for six years because the law requires it, but a customer can ask us to delete their \
marketing preferences and their account at any time. Support by phone is available from eight in the \
morning until eight in the evening on weekdays and from nine until five on Saturdays. The chat \
service, which is you, answers at any time, and urgent cases such as a leaking appliance or a burning \
smell must always be told to switch the appliance off at the socket, turn off the water supply if \
needed, and call the phone line or, in an emergency, the fire service.

8. Complaints and compensation.
If a customer is unhappy with our service, apologise sincerely and offer to open a complaint. A \
complaint is answered by a human colleague within five working days. Support assistants may offer a \
goodwill voucher of ten pounds when a delivery was more than one day late through our own fault, or \
when a technician missed a booked visit. Any larger compensation must be decided by a human \
colleague. Do not promise refunds, replacements or compensation that this policy does not allow, and \
do not discuss the policies of other companies.
"""

SUPPORT_MESSAGES = [
    "Hello, I ordered a washing machine from your website nine days ago and it was delivered on Monday "
    "by two very friendly men. They also installed it, which I paid forty-five pounds for. Yesterday I "
    "noticed that the price of exactly the same model in white has dropped by sixty pounds on your "
    "website. I think that is a bit unfair, because I bought it only a week before the sale started. Is "
    "there anything you can do for me? I still have the confirmation email with the order number. I "
    "would also like to know whether registering the machine on your website gives me any extra "
    "benefits, because I have not done that yet and I am not sure whether it is worth the effort.",
    "Good evening. My new refrigerator arrived this afternoon and the delivery crew left before I had "
    "taken off all of the cardboard and plastic. Now that it is unpacked I can see a long scratch and a "
    "small dent on the left side, near the bottom. It will be standing next to a wall, so to be honest "
    "nobody will ever see it, but I am still disappointed because it was quite expensive. I have taken "
    "some photographs of the side and of the box. What are my options? I would prefer not to wait for "
    "another delivery, because I have already thrown away my old fridge and I need somewhere to keep "
    "the food for my family this week. Please tell me what I should do next.",
    "Hi there, I live on the fourth floor of an old building without a lift, and I want to buy one of "
    "your large dishwashers together with a matching dryer. Could you tell me how much extra I would "
    "have to pay for the stairs? Would it be twenty-five pounds in total, or for each appliance, or for "
    "each floor? I also have an old dryer that I would like you to take away when the new one comes. "
    "It still works, but it is very noisy. Do I need to do anything with it before the crew arrives? "
    "Finally, I work during the day, so I would like to know how I will find out the time of the "
    "delivery, because I will need to ask my neighbour to let the crew in if I cannot be there myself.",
    "I bought a dishwasher from you fourteen months ago. For the last two weeks it has been leaving a "
    "white film on all of the glasses, and now it stops in the middle of the programme and shows an "
    "error code on the display. I looked in the manual, which says I should contact the service "
    "department. The water in our area is very hard, and I have to admit that I have not always used "
    "the special salt. Is this repair covered by the warranty? If it is not covered, how much is it "
    "going to cost me to have a technician look at it? I can find my order number in my account, but I "
    "do not know where to find the serial number on this model. Thank you for your help.",
    "Hello. I would like to return a stand mixer that I received as a birthday present three weeks "
    "ago. My sister bought it on your website and paid with her credit card. I have not used it at all, "
    "and everything is still in the original box, including the recipe book and all three attachments. "
    "The problem is that I already have a very similar mixer, so I would much rather have a toaster and "
    "a kettle instead. Can I return it myself, or does my sister have to do it? And who will receive "
    "the money, her or me? If the refund goes to her card, how long will it take? I also wonder whether "
    "I can simply exchange it for other products without sending it back first.",
    "I am writing because I am very unhappy. I booked a technician visit for my oven last Thursday "
    "between eight and twelve, and I took a day off work to be at home. Nobody came and nobody called. "
    "When I phoned your support line in the afternoon, the person I spoke to could not tell me what had "
    "happened. I have now booked a new visit for next Tuesday, but I have lost a day of pay because of "
    "your mistake. I think I deserve proper compensation for this, at least the money I lost, which was "
    "about one hundred and twenty pounds. I also want to be sure that this will not happen again on "
    "Tuesday. What are you going to do about it? Please answer quickly, this is the second time.",
    "Hi, quick question before I order. I would like to buy a built-in oven and an integrated "
    "refrigerator for my new kitchen, which is being fitted at the moment. Can your crew install both "
    "of them on the day of delivery? My kitchen fitter says he will have the cabinets ready, and there "
    "is a socket behind each space. I also wonder whether I can pay part of the price by bank transfer "
    "and the rest with a Brightwater gift card that I received from my colleagues when I moved house. "
    "Lastly, I live on one of the islands, so please let me know how long the delivery would take to "
    "reach me, because the fitter wants to finish the kitchen before the end of next month.",
    "Hello, my washing machine, which I bought from you five months ago, started leaking this morning. "
    "There is water all over the kitchen floor and I can smell something a bit like burning plastic "
    "coming from the back. The machine is still running at the moment because I did not know whether I "
    "should stop it in the middle of the programme. I have my order number here. What should I do right "
    "now, and will you repair or replace the machine? I would rather have a new one, because I do not "
    "trust it any more. By the way, my card number is on the invoice in my account if you need it to "
    "process anything. I am quite worried, so please tell me the most important steps first.",
]

FEW_SHOT_EXAMPLES = """\
Solve each word problem. Think step by step, show the arithmetic, and finish with a line that starts \
with "Answer:".

Problem: A bakery sells bread rolls in bags of six. On Monday it sold 14 bags in the morning and 9 \
bags in the afternoon. How many rolls did it sell on Monday?
Solution: The bakery sold 14 + 9 = 23 bags. Each bag has 6 rolls, so it sold 23 x 6 = 138 rolls.
Answer: 138

Problem: Maria has 250 pounds. She buys a coat for 89 pounds and two scarves that cost 17 pounds \
each. How much money does she have left?
Solution: The scarves cost 2 x 17 = 34 pounds. Together with the coat she spends 89 + 34 = 123 \
pounds. She has 250 - 123 = 127 pounds left.
Answer: 127

Problem: A train travels at 80 kilometres per hour for 2 hours and then at 60 kilometres per hour for \
another 90 minutes. How far does it travel in total?
Solution: In the first part it travels 80 x 2 = 160 kilometres. Ninety minutes is 1.5 hours, so in \
the second part it travels 60 x 1.5 = 90 kilometres. In total it travels 160 + 90 = 250 kilometres.
Answer: 250

Problem: A garden is 12 metres long and 7 metres wide. A path 1 metre wide runs along the inside of \
all four edges. What area of the garden is not covered by the path?
Solution: The part inside the path is 12 - 2 = 10 metres long and 7 - 2 = 5 metres wide. Its area is \
10 x 5 = 50 square metres.
Answer: 50

Problem: Three friends share the cost of a holiday cottage equally. The cottage costs 95 pounds per \
night and they stay for 6 nights. They also pay a cleaning fee of 45 pounds. How much does each \
friend pay?
Solution: The nights cost 95 x 6 = 570 pounds. With the cleaning fee the total is 570 + 45 = 615 \
pounds. Each friend pays 615 / 3 = 205 pounds.
Answer: 205

"""

WORD_PROBLEMS = [
    "A school orders new chairs for 7 classrooms. Each classroom needs 28 chairs, and the school also "
    "wants 15 spare chairs for the hall. The chairs come in boxes of 4. How many boxes does the school "
    "need to order, and how many chairs will be left over after every classroom and the hall have "
    "theirs?",
    "Tom runs 5 kilometres every weekday and 12 kilometres on Saturday. He rests on Sunday. In March "
    "he was ill for one full week, from Monday to Sunday, and did not run at all. If March had four "
    "complete weeks and three extra weekdays, how many kilometres did Tom run in March?",
    "A cinema has 18 rows of seats with 24 seats in each row. For an evening film, 3 out of every 4 "
    "seats were sold. Adult tickets cost 9 pounds and child tickets cost 6 pounds, and 120 of the tickets "
    "sold were for children. How much money did the cinema take for this film?",
    "A water tank holds 1200 litres. It is filled by a pipe that adds 40 litres per minute, while a tap "
    "at the bottom lets out 15 litres per minute. The tank starts with 200 litres in it and both the "
    "pipe and the tap are open. How many minutes does it take until the tank is full?",
    "A shop buys notebooks for 1.20 pounds each and sells them for 2 pounds each. In one week it buys "
    "300 notebooks, sells 240 of them at the full price and sells the rest at half price at the end of "
    "the week. What is the shop's profit on the notebooks for that week?",
    "Anna reads 35 pages of a novel every evening. The novel has 412 pages, and she had already read "
    "the first 62 pages before she started reading every evening. On how many evenings does she need to "
    "read to finish the book, and how many pages will she read on the last evening?",
    "A farmer plants apple trees in rows. Each row has 16 trees, and there are 25 rows. Every tree gives "
    "about 45 kilograms of apples, but one in every eight trees is too young to give fruit this year. "
    "How many kilograms of apples does the farmer expect to pick this year?",
    "A bus leaves the station every 12 minutes, starting at 6:00 in the morning, and the last bus leaves "
    "at 22:48. Each bus can carry 55 passengers. How many buses leave the station each day, and how many "
    "passengers can they carry in total if every bus is full?",
]

RAG_DOCUMENT = """\
The Ashford Valley Water Project: A Report on Twenty Years of Change

Introduction

When the town of Ashford began planning a new water system in the early years of the century, its \
two main sources of water were a slow river and a group of old wells on the northern edge of town. \
Both were under strain. The population had grown from about eighteen thousand people to almost \
thirty thousand in a single generation, the wells were drawing water faster than the rain could \
refill them, and in dry summers the river fell so low that the town council had to ban the use of \
garden hoses for weeks at a time. This report describes how the Ashford Valley Water Project was \
planned, built and run over twenty years, what it cost, what went wrong, and what other small towns \
can learn from it. It is based on council records, interviews with engineers and residents, and the \
annual reports of the water company that now runs the system.

The problem

In the summer of the drought year that later gave the project its urgency, the river at the town \
weir measured less than a third of its normal flow. Three of the nine wells ran dry, and water \
pressure in the houses on Hill Street and the streets above it became so weak that upstairs taps \
often produced only a trickle in the evening. The local hospital had to bring in water by lorry for \
eleven days. Farmers in the valley, who took water from the same river for their cattle and crops, \
complained that the town was taking more than its share, and for the first time in living memory \
there were public meetings where neighbours argued openly about water.

Engineers hired by the council studied the situation for a year. Their report found three separate \
problems. First, about a quarter of all the water that left the treatment works never reached a tap, \
because it leaked out of old cast-iron pipes, some of which had been laid more than a hundred years \
earlier. Second, the town had no way of storing water from the wet winter months for use in summer; \
the only reservoir was a small tank on the hill, which held enough water for about a day and a half. \
Third, the wells were drawing from an underground layer of sandstone that was slowly being emptied, \
and the engineers warned that if pumping continued at the same rate, salty water from deeper layers \
might begin to seep in within fifteen years.

The plan

The council considered four options. The cheapest was to buy water from the neighbouring city through \
a new pipeline, but the city could not promise a supply during droughts, which was exactly when \
Ashford would need it most. The second option was to drill deeper wells, which the engineers rejected \
because of the risk of salt. The third was a large dam across the upper valley, which would have \
flooded two farms and a stretch of woodland that was home to a rare kind of bat, and which was \
opposed by most residents at a public vote. The fourth option, which the council finally chose, \
combined several smaller measures: replacing the worst of the old pipes, building a storage \
reservoir in a disused quarry to the east of town, taking water from the river only in winter when \
it was high, and reducing demand through meters and a programme of water-saving devices.

The quarry reservoir was the centre of the plan. The old limestone quarry had closed forty years \
earlier and had slowly filled with rainwater to a depth of a few metres. Engineers calculated that, \
after the floor was sealed with a layer of clay and the walls were made safe, it could hold about \
two million cubic metres of water, enough to supply the town for roughly five months without any \
other source. In winter, when the river was high, pumps at a new intake would move water from the \
river to the quarry through a pipe four kilometres long. In summer the pumps would stop, and the \
town would draw from the quarry instead, leaving the river to the farmers and the fish.

Cost and funding

The total cost of the project was estimated at forty-two million pounds at the start and finally \
came to fifty-one million, an overrun of about twenty-one percent. Roughly half of the money came \
from a national fund for water security, which paid for the reservoir and the intake. A quarter came \
from a long-term loan that the water company is repaying through water bills over thirty years, and \
the rest came from the council's own budget and from a small charge added to the price of new houses \
built in the town. The largest single reason for the overrun was the discovery, during the sealing \
of the quarry floor, of a large crack in the rock that had not appeared in the surveys; repairing it \
took seven months and cost almost five million pounds. Rising steel prices added another two million \
to the cost of the pipes.

For residents, the average water bill rose by about eighteen percent over the first five years. The \
council tried to soften this by giving every household a free set of water-saving devices, including \
low-flow shower heads, tap aerators and a device for the toilet cistern, and by offering low-income \
families a reduced rate for the first twelve cubic metres of water each month. Surveys found that \
most residents accepted the higher bills once the summer bans ended, although a group of residents \
on the western estate campaigned against the meters for several years.

Building the system

Construction took six years. The pipe replacement started first, because it could be done street by \
street and brought benefits immediately. Crews replaced about ninety kilometres of pipe, roughly a \
third of the whole network, choosing the pipes with the most recorded bursts. They used a method in \
which a new plastic pipe is pulled through the old one, which meant that most roads only had to be \
dug up at the ends of each section rather than along their whole length. Residents of the old town \
centre, where the streets are narrow and paved with stone, were particularly grateful for this.

The quarry works began in the second year. The walls of the quarry were cut back to a safe angle and \
covered with netting to stop loose rock from falling, the floor was cleaned and covered with a layer \
of clay about one metre thick, and a concrete tower was built at the deepest point to hold the \
outlet pipes. The crack in the floor was found in the fourth year, when a test filling showed that \
the water level was falling faster than evaporation could explain. Divers and a team of geologists \
traced the leak to a fault in the limestone, which was finally sealed by injecting a mixture of \
cement and clay under pressure. The reservoir was filled for the first time in the winter of the \
sixth year and supplied the town for its first full summer the following year.

The river intake was the most controversial part of the works. Anglers and a local wildlife group \
worried that the pumps would harm the salmon and trout that swim up the river to lay their eggs in \
autumn. After a long discussion, the water company agreed to strict rules: the intake may only \
operate when the river flow at the weir is more than twice its average summer level, the intake is \
covered by a fine screen that keeps out young fish, and the pumps are switched off completely during \
the six weeks when the salmon are moving upstream. An independent ecologist checks the river every \
year, and her reports have so far found no decline in fish numbers; in fact the number of young \
salmon has increased, probably because the river now keeps more of its water during the summer.

Meters and demand

Before the project, fewer than one in ten homes in Ashford had a water meter; everyone else paid a \
fixed charge based on the value of their property. The council decided to fit meters to every home \
over four years, starting with the largest users. The effect was larger than expected. Average use \
per person fell from about one hundred and fifty litres a day to about one hundred and fifteen, a \
drop of nearly a quarter. Part of this came from households fixing dripping taps and leaking \
toilets that they had ignored for years, and part from changes in habits, such as shorter showers and \
fuller washing machines. The meters also helped the water company find leaks on private property: \
when a meter showed water running all night, the company sent a letter, and in the first year alone \
it found more than four hundred leaking pipes under gardens and driveways.

Not everyone benefited equally. Large families in small houses, who had previously paid low fixed \
charges, often found that their bills went up. The reduced rate for the first twelve cubic metres \
helped, but a study by the local university found that about one household in twelve was paying more \
than five percent of its income on water, compared with one in thirty before the meters. The council \
responded by introducing a special rate for families with three or more children and for people who \
need extra water for medical reasons, such as patients on home dialysis.

Results

Twenty years after the first council vote, the results are clear in most respects. There has not \
been a single hose ban since the reservoir came into use, even though two of the summers since then \
were drier than the drought year that started the project. Leakage from the network fell from about \
a quarter of all treated water to about eleven percent, which is better than the national average. \
The wells are now used only as a reserve, and measurements show that the water level in the \
sandstone has risen by about four metres, removing the danger of salt water for the foreseeable \
future. The river keeps more of its summer flow, the farmers in the valley have had enough water \
even in dry years, and the number of young salmon counted each autumn has roughly doubled.

The quarry reservoir has also become an unexpected attraction. A path was built around its rim when \
the walls were made safe, and it is now one of the most popular walks in the area, with views across \
the valley. Swimming and boating are not allowed, because the water is used for drinking, but the \
water company runs guided visits to the outlet tower in summer, and local schools use the site to \
teach children where their water comes from. Several kinds of water birds now nest on the rocky \
ledges, and the rare bats from the upper valley have been seen feeding over the water at dusk.

Problems and criticism

The project was not without its failures. The cost overrun led to a long dispute between the council \
and the main construction company about who should pay for the crack in the quarry floor; it was \
finally settled out of court, and the terms were never made public, which many residents thought was \
wrong for a project paid for with public money. The intake pumps broke down twice in their first \
three winters, because the fine fish screen clogged with leaves much faster than the designers had \
expected; a self-cleaning screen was fitted in the fourth winter and has worked well since. Some \
residents still say that the town should have bought water from the city, which would have been \
cheaper in the short term, although the drought that hit the city eight years later, when it had to \
cut supplies to its own neighbourhoods, persuaded most of them that Ashford made the right choice.

The quality of the water was also questioned in the first summer after the reservoir opened, when \
some residents complained of an earthy taste. The cause turned out to be a natural substance produced \
by tiny plants in the warm upper layer of the reservoir. It was harmless, but unpleasant, and the \
water company solved the problem by taking water from deeper in the reservoir, where it stays cool, \
and by adding a layer of activated carbon to the treatment works. There have been no complaints about \
taste since then.

Lessons for other towns

The engineers and council members interviewed for this report agreed on several lessons. The first \
is that the cheapest water is the water that does not leak away: fixing pipes and fitting meters \
saved almost as much water as the reservoir provides, at a fraction of the cost. The second is that \
storage changes everything. A river that is too low in summer can be more than enough for a town if \
some of its winter water can be kept for later. The third is that a combination of small measures \
can be more popular and more flexible than one large project, because each part can be adjusted as \
the town learns. The fourth is that surveys of the ground are never complete, and that a budget for \
unknown problems of at least a quarter of the estimated cost is wise. The last lesson is about \
people: the project succeeded because the council explained its plans openly, listened to the \
farmers, the anglers and the residents, and changed the design when they raised good objections. \
The strict rules for the river intake, which began as a concession to the wildlife group, are now \
seen as one of the best features of the whole system.

Looking ahead, the water company expects the town to grow by another five thousand people over the \
next fifteen years. Its plans include replacing a further third of the old pipes, using treated waste \
water for watering parks and sports fields, and raising the height of the quarry walls by two \
metres, which would increase the storage by about fifteen percent. For now, however, the people of \
Ashford can water their gardens in August without a second thought, which is perhaps the simplest \
measure of the project's success.
"""

RAG_QUESTIONS = [
    "According to the report, what were the three main problems that the engineers found?",
    "Why did the council reject the option of building a large dam across the upper valley?",
    "How much did the project finally cost, and what was the main reason for the overrun?",
    "What rules protect the salmon and trout at the river intake?",
    "How did water meters change the amount of water that people in Ashford use each day?",
    "What caused the earthy taste in the water, and how was it fixed?",
    "Which groups of residents were hurt by the introduction of meters, and what did the council do?",
    "What are the lessons for other towns that the people interviewed agreed on?",
]

# Multi-turn chats with the library assistant of the seed demo: one list of user turns per chat.
LIBRARY_CHATS = [
    ["Hi, I just moved to the city. How do I get a library card?",
     "Do I need to bring anything to prove my address?",
     "How many books can I take home at once?",
     "And how long can I keep them?",
     "What if I need a book for longer than that?",
     "Can I do that online, or do I have to come in?",
     "Thanks. Is the main branch open on Saturdays too?",
     "Great, see you then. Have a nice day!"],
    ["My daughter is seven. Can she have her own library card?",
     "Will she have to pay late fees if she forgets to bring books back?",
     "Are there reading activities for children her age?",
     "She loves stories about animals. Any suggestions?",
     "Can we reserve a book that is already borrowed by someone else?",
     "How will we know when it is ready to collect?",
     "Can she return books at a different branch?",
     "Thank you, that was very helpful."],
    ["I lost my library card on the bus yesterday. What should I do?",
     "Will someone else be able to borrow books with it?",
     "How much does a replacement card cost?",
     "I also have two books that are due tomorrow. Can I still renew them without the card?",
     "One of them has a reservation from another member. What happens then?",
     "Is there a place to return books when the library is closed?",
     "Okay. Can I ask someone at the front desk about this?",
     "Thanks for your patience."],
    ["Do you have books in languages other than English?",
     "I am learning Spanish. Which books would you recommend for a beginner?",
     "Can I borrow audiobooks as well as printed books?",
     "Do audiobooks count towards the limit of twelve items?",
     "How long is the loan period for audiobooks?",
     "Is there a quiet room where I can study?",
     "Can I book it in advance for next Tuesday evening?",
     "Perfect, thank you very much."],
    ["Can I use the computers at the library?",
     "Do I need my library card to log in?",
     "Is there a limit on how long I can use a computer each day?",
     "Can I print documents there, and how much does it cost?",
     "What about scanning a few pages from a reference book?",
     "Is there wifi for my own laptop?",
     "Does the main branch close early on any weekday?",
     "Alright, that covers everything. Bye!"],
    ["I returned a comic book three days late. Will I be charged?",
     "It was my son's book, he is nine. Does that change anything?",
     "He also wants to borrow a video game. Do you lend those?",
     "How many items can a child borrow at the same time?",
     "Can I renew his books from my own account?",
     "What happens if a book gets damaged by accident?",
     "Who do I talk to about that?",
     "Thanks, I appreciate your help."],
]

# Unrelated prompts (plain text, no chat template, so nothing is shared from the first token on).
UNRELATED_PROMPTS = [
    "Photosynthesis is the process by which green plants turn light into chemical energy. In simple "
    "terms, explain what happens to the carbon dioxide that a leaf takes in from the air.",
    "Write a short poem about a lighthouse keeper who watches the winter storms from his window and "
    "waits for the supply boat that is already two weeks late.",
    "Three reasons why regular exercise improves sleep quality, explained for a teenager who stays up "
    "late playing games:",
    "In the history of aviation, the first flights across the Atlantic Ocean were dangerous "
    "adventures. Describe what pilots had to carry with them on such a journey.",
    "Recipe for a simple vegetable soup that can be cooked in thirty minutes with carrots, potatoes, "
    "onions and a few herbs. Ingredients and steps:",
    "Dear hiring manager, I am writing to apply for the position of junior accountant that was "
    "advertised on your website last week. My experience includes",
    "Volcanoes form where molten rock from deep inside the Earth reaches the surface. Explain the "
    "difference between an active volcano and a dormant one.",
    "Once upon a time, in a small village at the edge of a great forest, there lived an old clockmaker "
    "who had never once been late for anything. One morning,",
]
